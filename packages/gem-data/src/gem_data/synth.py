"""``gem data synth``: write a generated ads log as a Parquet data set."""

from __future__ import annotations

from pathlib import Path

import attrs

from gem_data.generator import AdsLogGenerator, SynthOptions
from gem_data.manifest import Manifest
from gem_data.writer import DatasetWriter


def synthesize(out: str | Path, *, rows: int, seed: int, eval_rows: int = 8192,
               options: SynthOptions | None = None, row_group_rows: int = 16384) -> Manifest:
    """Generate ``rows`` training and ``eval_rows`` held-out impressions into ``out``.

    Each row group is one generator chunk, so the data set is a pure function of its arguments
    (and memory stays at one chunk, whatever ``rows`` is).
    """
    options = options or SynthOptions()
    generator = AdsLogGenerator(options, seed=seed)
    info = {"source": "gem data synth", "seed": seed, "rows": rows, "eval_rows": eval_rows,
            "row_group_rows": row_group_rows, "options": attrs.asdict(options)}
    writer = DatasetWriter(out, generator.schema, row_group_rows=row_group_rows, info=info)
    for split, count in (("train", rows), ("eval", eval_rows)):
        for index, start in enumerate(range(0, count, row_group_rows)):
            n = min(row_group_rows, count - start)
            writer.write(split, generator.chunk(n, split=split, index=index))
    return writer.close()
