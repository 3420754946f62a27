"""``gem score``: batch-score a Parquet data set with a model exported by ``gem export-model``.

The exported program is loaded with torch alone (``torch.export.load``, or AOTInductor's
package with ``--aoti``); nothing of the trained run is needed. The export is untrusted input:
every file is checked against the size and SHA-256 its manifest records, and a program that
holds code (pickles, Python in its graph) is refused before torch sees it
(:mod:`gem_core.serving.loading`); every such problem is a one-line error naming the file.
Which program scores:

* ``ranker`` when the export has one and the data set carries the cached user embedding (a data
  set written by ``gem export-user-embeddings`` from the same run): the upstream is not run;
* ``full`` otherwise (history, context and candidates in, probabilities out).

Output (``--out DIR``): one Parquet file per scored split, ``predictions-<split>.parquet``, one
row per request in the data set's order (``row``: the request's index in its split), with one
``list<float32>`` column per task holding the predicted probability of each of the request's
candidates, in the data set's candidate order; and ``score.json`` with NE, AUC, calibration and
log loss per task and split (from the logits, by :func:`gem_core.metrics.task_report`, as the
trainer's evaluation computes them). Predictions are keyed by row rather than appended to a copy
of the data set: they are small next to the histories and join back on ``row``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import attrs
import click
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import Tensor

from gem_core.config import DataConfig
from gem_core.errors import GemDataError
from gem_core.metrics import task_report
from gem_core.schema import FeatureSchema, schema_to_dict
from gem_core.serving.inputs import batch_inputs
from gem_core.serving.integrity import MANIFEST, open_export, trained_schema
from gem_core.serving.loading import load_program
from gem_data.dataset import split_units
from gem_data.loader import ParquetStream
from gem_data.sources import ParquetOptions, ParquetSource

#: Schema fields that may differ between the export and the scored data: the history cap (the
#: export's is applied when reading) and the cached embedding (checked per program).
_IGNORED = ("max_seq_len", "user_embedding_dim")


@attrs.frozen(kw_only=True)
class ExportedModel:
    """One program of an export directory, loaded for scoring."""

    name: str
    """``full`` or ``ranker``."""
    manifest: dict[str, Any]
    """The export's ``manifest.json``."""
    schema: FeatureSchema
    """The schema the model was trained on."""
    groups: tuple[str, ...]
    """The input groups the program reads (:mod:`gem_core.serving.inputs`)."""
    call: Callable[[dict[str, Tensor]], Mapping[str, Tensor]]
    """The loaded program."""


def load_exported(model_dir: Path, program: str, *, aoti: bool = False,
                  manifest: dict[str, Any] | None = None) -> ExportedModel:
    """Load ``program`` of the export in ``model_dir`` (the ``.pt2``, or the AOTInductor package
    with ``aoti``) through :func:`gem_core.serving.loading.load_program`: every file verified
    against the manifest's digests (``manifest``: one :func:`open_export` already verified),
    nothing unpickled."""
    manifest = manifest if manifest is not None else open_export(model_dir)
    entry = manifest["programs"].get(program)
    if entry is None or program == "user_tower":
        raise GemDataError(f"{model_dir} has no scoring program {program!r}; it has "
                           f"{sorted(set(manifest['programs']) - {'user_tower'})}")
    return ExportedModel(name=program, manifest=manifest,
                         schema=trained_schema(manifest, model_dir / MANIFEST),
                         groups=tuple(entry["groups"]),
                         call=load_program(model_dir, manifest, program, aoti=aoti))


def choose_program(manifest: dict[str, Any], data_schema: FeatureSchema) -> str:
    """``ranker`` if the export has one and the data carries its cached user embedding."""
    if "ranker" in manifest["programs"] and "full" not in manifest["programs"]:
        return "ranker"
    if ("ranker" in manifest["programs"]
            and data_schema.user_embedding_dim == manifest.get("user_embedding_dim")):
        return "ranker"
    return "full"


def check_schema(model: ExportedModel, data_schema: FeatureSchema, data_dir: Path) -> None:
    """Raise GemDataError naming every part of the data set's schema that differs from the one
    the exported model was trained on."""
    want = {k: v for k, v in schema_to_dict(model.schema).items() if k not in _IGNORED}
    have = {k: v for k, v in schema_to_dict(data_schema).items() if k not in _IGNORED}
    differences = [f"{key}: the model has {want.get(key)!r}, the data has {have.get(key)!r}"
                   for key in sorted(set(want) | set(have)) if want.get(key) != have.get(key)]
    if differences:
        raise GemDataError(f"{data_dir} does not have the feature schema the exported model "
                           f"was trained on: {'; '.join(differences)}")
    if "user_embedding" in model.groups:
        width = model.manifest["user_embedding_dim"]
        if data_schema.user_embedding_dim != width:
            raise GemDataError(
                f"{data_dir} has user embeddings of {data_schema.user_embedding_dim} floats; the "
                f"ranker reads {width} (write them with gem export-user-embeddings from the "
                "same run, or score with --program full)")


def _split_batches(source: ParquetSource, split: str, batch_size: int, data_dir: Path):
    """The requests of ``split`` as the data set's manifest lists them (never row groups of
    another split: the training source's held-out tail is no eval split)."""
    units = split_units(source.manifest, split)
    if not units or not sum(u.rows for u in units):
        raise GemDataError(f"{data_dir} has no {split} rows (its manifest.json lists "
                           f"{len(source.manifest.splits.get(split, ()))} {split} files, "
                           f"{sum(u.rows for u in units)} rows): nothing to score as "
                           f"{split!r}; score another --split or import the data with an "
                           f"{split} split")
    reader = source._reader()  # noqa: SLF001 - the source's own reader, with its policy
    return ParquetStream(reader, units, batch_size=batch_size, seed=0, shuffle=False, epochs=1,
                         prefetch=0)


def score(model_dir: Path, data_dir: Path, out: Path, *, splits: tuple[str, ...] = ("eval",),
          program: str | None = None, batch_size: int = 256,
          aoti: bool = False) -> dict[str, Any]:
    """Score ``splits`` of ``data_dir`` with the export in ``model_dir``; write predictions and
    ``score.json`` to ``out`` and return the summary."""
    manifest = open_export(model_dir)
    trained = trained_schema(manifest, model_dir / MANIFEST)
    source = ParquetSource(DataConfig(source="parquet", path=str(data_dir),
                                      max_seq_len=trained.max_seq_len), seed=0,
                           options=ParquetOptions())
    batches = {split: _split_batches(source, split, batch_size, data_dir) for split in splits}
    name = program or choose_program(manifest, source.schema)
    model = load_exported(model_dir, name, aoti=aoti, manifest=manifest)
    check_schema(model, source.schema, data_dir)
    tasks = tuple(manifest["tasks"])
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"model": str(model_dir), "data": str(data_dir), "program": name,
                               "aoti": aoti, "checkpoint_step": manifest["checkpoint_step"],
                               "splits": {}}
    for split in splits:
        started = time.perf_counter()
        logits: dict[str, list[Tensor]] = {t: [] for t in tasks}
        labels: dict[str, list[Tensor]] = {t: [] for t in tasks}
        columns: dict[str, list[Any]] = {"row": [], **{t: [] for t in tasks}}
        rows = 0
        for batch in batches[split]:
            with torch.no_grad():
                outputs = model.call(batch_inputs(batch, source.schema, model.groups))
            offsets = batch.candidate_offsets.numpy()
            columns["row"].append(np.arange(rows, rows + batch.batch_size, dtype=np.int64))
            for task in tasks:
                probs = outputs[task].float().numpy()
                columns[task].append(pa.ListArray.from_arrays(
                    pa.array(offsets.astype(np.int32)), pa.array(probs, type=pa.float32())))
                logits[task].append(outputs[f"{task}.logit"].float())
                labels[task].append(batch.labels[task])
            rows += batch.batch_size
        table = pa.table({"row": pa.array(np.concatenate(columns["row"]) if rows else [],
                                          type=pa.int64()),
                          **{t: pa.concat_arrays(columns[t]) if rows
                             else pa.array([], type=pa.list_(pa.float32())) for t in tasks}})
        file = out / f"predictions-{split}.parquet"
        pq.write_table(table, file)
        metrics = {t: task_report(torch.cat(logits[t]), torch.cat(labels[t])) for t in tasks
                   } if rows else {}
        summary["splits"][split] = {"rows": rows, "file": file.name, "metrics": metrics,
                                    "seconds": round(time.perf_counter() - started, 3)}
    (out / "score.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


@click.command("score")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--data", "data_dir", required=True,
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Parquet data set directory (gem-data format 2) to score.")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Directory for predictions-<split>.parquet and score.json.")
@click.option("--split", "splits", multiple=True, type=click.Choice(["train", "eval"]),
              default=("eval",), show_default=True, help="Split to score (repeatable).")
@click.option("--program", type=click.Choice(["full", "ranker"]), default=None,
              help="Program to score with (default: the ranker when the data carries the "
                   "cached user embedding, else the full model).")
@click.option("--batch-size", default=256, show_default=True, type=click.IntRange(min=1),
              help="Requests per call of the program.")
@click.option("--aoti", is_flag=True, help="Score with the AOTInductor package.")
def score_command(model_dir: Path, data_dir: Path, out: Path, splits: tuple[str, ...],
                  program: str | None, batch_size: int, aoti: bool) -> None:
    """Score a Parquet data set with an exported model; write predictions per task and, where
    the data has labels, NE/AUC per task."""
    summary = score(model_dir, data_dir, out, splits=tuple(dict.fromkeys(splits)),
                    program=program, batch_size=batch_size, aoti=aoti)
    for split, part in summary["splits"].items():
        click.echo(f"{split}: {part['rows']} requests scored by {summary['program']!r} in "
                   f"{part['seconds']:.2f} s -> {out / part['file']}")
        for task, report in part["metrics"].items():
            click.echo(f"  {task}: NE {report['ne']:.4f}, AUC {report['auc']:.4f}")
    click.echo(f"scored with the export of checkpoint step {summary['checkpoint_step']} "
               "(gem export-model exports the best checkpoint unless --step names another)")
