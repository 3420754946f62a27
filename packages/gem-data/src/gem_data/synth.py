"""``gem data synth``: write a generated ads log as a Parquet data set (one row per request)."""

from __future__ import annotations

from pathlib import Path

import attrs

from gem_data.generator import AdsLogGenerator, achievable_entries, achievable_figures
from gem_data.indicator_ne import TRAIN_ROWS, indicator_regression_ne
from gem_data.manifest import Manifest
from gem_data.synth_options import SynthOptions
from gem_data.writer import DatasetWriter


def synthesize(out: str | Path, *, rows: int, seed: int, eval_rows: int = 8192,
               options: SynthOptions | None = None, row_group_rows: int = 16384) -> Manifest:
    """Generate ``rows`` training and ``eval_rows`` held-out requests into ``out``.

    Each training row group is one generator chunk, so the data set is a pure function of its
    arguments (and memory stays at one chunk, whatever ``rows`` is). The eval split is written in
    the generator's fixed eval chunks, the same requests the ``synthetic-ads`` source evaluates
    on. The manifest's ``info.achievable_ne`` holds, per task, the NE of the generating process's
    true probabilities on the eval split: the floor to compare a model's eval NE with
    (``achievable_auc`` and ``achievable_gauc`` their AUC and GAUC: the ceilings of ranking);
    ``info.indicator_ne`` the NE there of a logistic regression on the planted kind's indicators
    (fitted on :data:`~gem_data.indicator_ne.TRAIN_ROWS` training requests of the generator,
    cut in chunks of their own whatever ``rows`` and ``row_group_rows`` are: see
    :func:`~gem_data.indicator_ne.indicator_regression_ne`).
    """
    options = options or SynthOptions()
    generator = AdsLogGenerator(options, seed=seed)
    info = {"source": "gem data synth", "seed": seed, "rows": rows, "eval_rows": eval_rows,
            "row_group_rows": row_group_rows, "options": attrs.asdict(options)}
    if eval_rows:
        info.update(achievable_entries(achievable_figures(generator, eval_rows)))
        info["indicator_ne"] = indicator_regression_ne(generator, TRAIN_ROWS, eval_rows)
    writer = DatasetWriter(out, generator.schema, row_group_rows=row_group_rows, info=info)
    for index, start in enumerate(range(0, rows, row_group_rows)):
        writer.write("train", generator.chunk(min(row_group_rows, rows - start), split="train",
                                              index=index))
    for index, size in generator.eval_chunks(eval_rows):
        writer.write("eval", generator.chunk(size, split="eval", index=index))
    return writer.close()
