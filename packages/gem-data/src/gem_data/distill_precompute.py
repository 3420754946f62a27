"""``gem distill-precompute``: a data set plus a teacher's signals, for ``gem distill --signals
precomputed``.

Reads a format 2 data set and writes it again with two more column kinds (docs/data-format.md):
``teacher_logit.<task>`` (the teacher's logit for every candidate) and, for a teacher with PMA,
``teacher_embedding`` (its user embedding per request). The student then trains without running
the teacher. The teacher sees each request's most recent ``data.max_seq_len`` events of the
teacher run's config, as it did in training; every original column is copied unchanged.

The unit of work is one row group of the input: it becomes one output file of one row group
(``train-00007.parquet``: the split's eighth row group), so the output has the input's row-group
sizes and order and a student's shuffled stream visits the same requests in the same order as on
the input. ``--shard I/N`` processes the units ``g`` with ``g % N == I`` (``g`` counts over the
train then the eval split), so N processes (or machines sharing the directory) split the work.
Each file is written under a temporary name and renamed when whole: running again skips the
files that exist (resumable). The manifest is written by whichever run finds every file present.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import click
import pyarrow as pa
import torch

from gem_core.config import DataConfig
from gem_core.distill.setup import read_teacher_config
from gem_core.distill.teacher import Teacher, open_teacher
from gem_core.errors import GemDataError
from gem_core.schema import FeatureSchema, without_teacher_signals
from gem_data import format as fmt
from gem_data.arrow_io import table_to_batch
from gem_data.batch_ops import slice_batch
from gem_data.dataset import DatasetReader, Unit, split_units
from gem_data.manifest import (
    Manifest,
    TimeWindow,
    read_manifest,
    with_digests,
    write_manifest,
)
from gem_data.writer import SPLITS, file_entry, write_file

PLAN_NAME = "precompute.json"


def _units(manifest: Manifest) -> list[tuple[str, int, Unit]]:
    """``(split, index within the split, unit)`` of every input row group, train first."""
    return [(split, index, unit) for split in SPLITS if split in manifest.splits
            for index, unit in enumerate(split_units(manifest, split))]


def _output_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.parquet"


def teacher_columns(teacher: Teacher, table: Any, schema: FeatureSchema, *, max_seq_len: int,
                    batch_size: int) -> dict[str, Any]:
    """The teacher's columns for the rows of ``table`` (the data set's ``schema`` without teacher
    columns), run ``batch_size`` requests at a time."""
    batch = table_to_batch(table, schema, max_seq_len=max_seq_len)
    logits: dict[str, list[torch.Tensor]] = {t: [] for t in teacher.tasks}
    embeddings: list[torch.Tensor] = []
    for start in range(0, batch.batch_size, batch_size):
        part = slice_batch(batch, start, min(start + batch_size, batch.batch_size))
        part_logits, embedding = teacher.signals(part)
        for task in teacher.tasks:
            logits[task].append(part_logits[task].cpu())
        if embedding is not None:
            embeddings.append(embedding.cpu())
    offsets = pa.array(batch.candidate_offsets.numpy().astype("int32"))
    columns = {fmt.teacher_logit_column(t): pa.ListArray.from_arrays(
        offsets, pa.array(torch.cat(logits[t]).numpy(), pa.float32())) for t in teacher.tasks}
    if teacher.embedding_dim:
        columns[fmt.TEACHER_EMBEDDING] = pa.FixedSizeListArray.from_arrays(
            pa.array(torch.cat(embeddings).numpy().reshape(-1), pa.float32()),
            teacher.embedding_dim)
    return columns


def precompute(teacher_dir: Path, data_dir: Path, out: Path, *, shard: int = 0,
               num_shards: int = 1, batch_size: int = 512) -> dict[str, Any]:
    """Write this shard's missing output files; write the manifest when every file exists.
    Returns what was done (files written, skipped, left to other shards)."""
    if not 0 <= shard < num_shards:
        raise click.BadParameter(f"shard {shard} of {num_shards}: need 0 <= I < N")
    if out.resolve() == data_dir.resolve():
        raise GemDataError(f"--out {out} is the input data set; write to another directory")
    manifest = read_manifest(data_dir)
    base = without_teacher_signals(manifest.schema)
    teacher_config = read_teacher_config(teacher_dir)
    max_seq_len = teacher_config.data.max_seq_len
    teacher = open_teacher(teacher_dir, data=DataConfig(source="parquet", path=str(data_dir),
                                                        max_seq_len=max_seq_len))
    schema = attrs.evolve(base, teacher_tasks=teacher.tasks,
                          teacher_embedding_dim=teacher.embedding_dim)
    plan = {"teacher": str(teacher_dir.resolve()), "teacher_step": teacher.run.step,
            "data": str(data_dir.resolve()), "teacher_max_seq_len": max_seq_len,
            "units": len(_units(manifest))}
    _check_plan(out, plan)
    reader = DatasetReader(data_dir, manifest=manifest)
    columns = fmt.arrow_schema(base).names
    done = {"written": 0, "skipped": 0, "other_shards": 0}
    for number, (split, index, unit) in enumerate(_units(manifest)):
        path = out / _output_name(split, index)
        if number % num_shards != shard:
            done["other_shards"] += 1
            continue
        if path.exists():
            done["skipped"] += 1  # written by an earlier run
            continue
        table = reader.read(unit).select(columns)
        if table.num_rows != unit.rows:
            raise GemDataError(f"{data_dir / unit.file}: row group {unit.row_group} lost "
                               f"{unit.rows - table.num_rows} rows to validation; repair the "
                               "input first (gem data validate) so the output keeps its rows")
        extra = teacher_columns(teacher, table, base, max_seq_len=max_seq_len,
                                batch_size=batch_size)
        for name, column in extra.items():
            table = table.append_column(name, column)
        # The file's list field names ("element") and nullability become the format's own.
        table = table.cast(fmt.arrow_schema(schema))
        write_file(path, table, schema, row_group_rows=max(unit.rows, 1))
        done["written"] += 1
    done["complete"] = _write_manifest_if_complete(out, manifest, schema, plan)
    return done


def _check_plan(out: Path, plan: dict[str, Any]) -> None:
    """The output directory belongs to one (teacher, data) pair: refuse to mix files."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / PLAN_NAME
    if path.exists():
        existing = json.loads(path.read_text())
        if existing != plan:
            changed = sorted(k for k in plan if existing.get(k) != plan[k])
            raise GemDataError(f"{out} holds teacher columns of another run of "
                               f"gem distill-precompute ({', '.join(changed)} differ: "
                               f"{ {k: existing.get(k) for k in changed} }); use another --out")
        return
    partial = path.with_name(PLAN_NAME + ".partial")
    partial.write_text(json.dumps(plan, indent=2) + "\n")
    partial.replace(path)


def _write_manifest_if_complete(out: Path, manifest: Manifest, schema: FeatureSchema,
                                plan: dict[str, Any]) -> bool:
    units = _units(manifest)
    paths = [out / _output_name(split, index) for split, index, _ in units]
    if not all(p.exists() for p in paths):
        return False
    splits: dict[str, list[Any]] = {}
    for (split, _, _), path in zip(units, paths):
        splits.setdefault(split, []).append(file_entry(path, schema))
    written = Manifest(schema=schema, splits={k: tuple(v) for k, v in splits.items()},
                       info={**manifest.info, "teacher_signals": plan},
                       windows=_output_windows(manifest, units))
    write_manifest(out, with_digests(out, written))
    return True


def _output_windows(manifest: Manifest, units: list[tuple[str, int, Unit]]) -> list[TimeWindow]:
    """The input's time windows over the output's files (one per input row group, in the same
    order), so a student can train on the output in time order (``data.order = "time"``). The
    windows' state files (what ``gem data import --append`` reads) stay with the input: append
    a window there and precompute again into a new ``--out``."""
    outputs: dict[str, list[str]] = {}
    for split, index, unit in units:
        if split == "train":
            outputs.setdefault(unit.file, []).append(_output_name(split, index))
    return [attrs.evolve(window, files=[name for file in window.files for name in outputs[file]],
                         state=()) for window in manifest.windows]


def _parse_shard(text: str) -> tuple[int, int]:
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected I/N, e.g. 0/4") from None
    if count < 1 or not 0 <= index < count:
        raise click.BadParameter(f"{text!r}: need N >= 1 and 0 <= I < N")
    return index, count


@click.command(name="distill-precompute")
@click.option("--teacher", "teacher_dir", required=True,
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="The teacher's run directory (needs a complete checkpoint).")
@click.option("--data", "data_dir", required=True,
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="The data set to add the teacher's columns to (same features as the "
                   "teacher's data).")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Directory of the data set to write (resumable: existing files are kept).")
@click.option("--shard", default="0/1", show_default=True,
              help="I/N: process every N-th row group starting at I.")
@click.option("--batch-size", default=512, show_default=True, type=click.IntRange(min=1),
              help="Requests per teacher forward.")
def distill_precompute(teacher_dir: Path, data_dir: Path, out: Path, shard: str,
                       batch_size: int) -> None:
    """Write a data set plus a teacher's logits and user embeddings, for gem distill
    --signals precomputed."""
    index, count = _parse_shard(shard)
    done = precompute(teacher_dir, data_dir, out, shard=index, num_shards=count,
                      batch_size=batch_size)
    click.echo(f"shard {index}/{count}: wrote {done['written']} files, kept {done['skipped']} "
               f"already written, left {done['other_shards']} to other shards; "
               + ("manifest written: the data set is complete" if done["complete"]
                  else "the data set is complete once every shard has run"))
