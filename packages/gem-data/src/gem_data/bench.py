"""``gem bench loader``: tokens/s and samples/s from Parquet on disk to training batches, ours and
the TorchRec path, measured in the same process on the same files, pinned to one core.

TorchRec path: pyarrow reads each row group, batches are cut the same way (``batch_size``
consecutive rows), and every list column goes through ``KeyedJaggedTensor.from_lengths_sync`` and
``to_dict()`` (per-feature jagged tensors); scalar columns become tensors. Ours: the streaming
loader (read, check every row, decode to a JaggedBatch), sequential (what the TorchRec path does)
and shuffled (what training uses), reading in the caller's thread (``prefetch=0``: on one core a
prefetch thread cannot overlap anything); sequential with the default prefetch thread is
reported too. Tokens are history events.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import click

GOAL_TOKENS_PER_S = 20e6


@contextlib.contextmanager
def _one_core() -> Iterator[str]:
    """Run every thread of this process on one core, so 'per core' means what it says; the
    previous affinity and thread counts come back afterwards."""
    import pyarrow as pa
    import torch

    threads, arrow_threads = torch.get_num_threads(), pa.cpu_count()
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    torch.set_num_threads(1)
    pa.set_cpu_count(1)
    try:
        if affinity:
            core = min(affinity)
            os.sched_setaffinity(0, {core})
            yield f"cpu {core}"
        else:
            yield "unpinned (no sched_setaffinity)"
    finally:
        if affinity:
            os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)
        pa.set_cpu_count(arrow_threads)


def _measure(batches: Iterable[Any], tokens_of: Callable[[Any], int],
             samples_of: Callable[[Any], int]) -> dict[str, float]:
    start = time.perf_counter()
    tokens = samples = count = 0
    for batch in batches:
        tokens += tokens_of(batch)
        samples += samples_of(batch)
        count += 1
    seconds = time.perf_counter() - start
    return {"seconds": round(seconds, 4), "batches": count, "samples": samples,
            "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1),
            "samples_per_s": round(samples / seconds, 1)}


def _ours(directory: Path, batch_size: int, shuffle: bool, prefetch: int = 0) -> dict[str, float]:
    from gem_data.dataset import DatasetReader, split_units
    from gem_data.loader import ParquetStream

    reader = DatasetReader(directory)
    stream = ParquetStream(reader, split_units(reader.manifest, "train"), batch_size=batch_size,
                           seed=0, shuffle=shuffle, epochs=1, prefetch=prefetch)
    try:
        return _measure(stream, lambda b: b.num_events, lambda b: b.batch_size)
    finally:
        stream.close()


def _torchrec_batches(directory: Path, batch_size: int) -> Iterable[tuple[int, int]]:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from gem_data import format as fmt
    from gem_data.arrow_io import list_parts, scalar_parts, tensor_view
    from gem_data.dataset import split_units
    from gem_data.manifest import read_manifest

    manifest = read_manifest(directory)
    schema = fmt.arrow_schema(manifest.schema)
    list_columns = [f.name for f in schema if pa.types.is_list(f.type)]
    other_columns = [f.name for f in schema if not pa.types.is_list(f.type)]
    handles: dict[str, Any] = {}
    pending: list[Any] = []
    rows = 0

    def convert(table: Any) -> tuple[int, int]:
        # The peer gets the same zero-copy column access as ours, so the comparison measures
        # the KJT construction and split, not a slower way of reading arrow buffers.
        parts = [list_parts(table.column(c)) for c in list_columns]
        lengths = [tensor_view(np.diff(offsets)) for _, offsets in parts]
        values = [tensor_view(v) for v, _ in parts]
        kjt = KeyedJaggedTensor.from_lengths_sync(list_columns, torch.cat(values),
                                                  torch.cat(lengths))
        features = kjt.to_dict()
        for c in other_columns:
            flat, _ = (list_parts(table.column(c)) if pa.types.is_fixed_size_list(
                table.schema.field(c).type) else (scalar_parts(table.column(c)), None))
            tensor_view(flat)
        return table.num_rows, int(features[fmt.HISTORY_ITEM].lengths().sum())

    for unit in split_units(manifest, "train"):
        if unit.file not in handles:
            handles[unit.file] = pq.ParquetFile(directory / unit.file)
        table = handles[unit.file].read_row_group(unit.row_group, columns=schema.names)
        start = 0
        while start < table.num_rows:
            take = min(batch_size - rows, table.num_rows - start)
            pending.append(table.slice(start, take))
            rows += take
            start += take
            if rows == batch_size:
                yield convert(pa.concat_tables(pending))
                pending, rows = [], 0
    if pending:
        yield convert(pa.concat_tables(pending))


def _torchrec_import_check() -> None:
    """Import torchrec before timing (its first import takes seconds); say so if it is missing."""
    try:
        import torchrec  # noqa: F401
    except ImportError as error:
        raise click.ClickException(f"the TorchRec peer needs torchrec: {error}") from None


@click.command(name="loader", help=__doc__.split("\n\n")[0])
@click.option("--path", type=click.Path(file_okay=False), default=None,
              help="Existing data set directory (default: generate one in a temp folder).")
@click.option("--rows", type=click.IntRange(min=1000), default=200_000, show_default=True,
              help="Rows to generate when --path is not given.")
@click.option("--batch-size", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_loader(path: str | None, rows: int, batch_size: int, as_json: bool) -> None:
    from gem_data.synth import synthesize

    with tempfile.TemporaryDirectory(prefix="gem-bench-loader-") as tmp:
        directory = Path(path) if path else Path(tmp) / "data"
        if not path:
            synthesize(directory, rows=rows, seed=0, eval_rows=0)
        _torchrec_import_check()
        with _one_core() as pinned:
            _ours(directory, batch_size, shuffle=False)  # warm the page cache for every reader
            result: dict[str, Any] = {
                "benchmark": "loader", "directory": str(directory), "batch_size": batch_size,
                "pinned": pinned,
                "ours_sequential": _ours(directory, batch_size, shuffle=False),
                "ours_shuffled": _ours(directory, batch_size, shuffle=True),
                "ours_sequential_prefetch_thread": _ours(directory, batch_size, shuffle=False,
                                                         prefetch=2),
                "torchrec": _measure(_torchrec_batches(directory, batch_size),
                                     lambda b: b[1], lambda b: b[0]),
            }
    ours = result["ours_sequential"]["tokens_per_s"]
    peer = result["torchrec"]["tokens_per_s"]
    result.update({
        "goal_tokens_per_s": GOAL_TOKENS_PER_S,
        "ours_vs_torchrec": round(ours / peer, 3) if peer else None,
        "meets_goal": ours >= GOAL_TOKENS_PER_S,
        "at_least_torchrec": ours >= peer,
    })
    if as_json:
        click.echo(json.dumps(result))
        return
    for name in ("ours_sequential", "ours_shuffled", "ours_sequential_prefetch_thread",
                 "torchrec"):
        r = result[name]
        click.echo(f"{name:32s} {r['tokens_per_s'] / 1e6:8.2f} M tokens/s "
                   f"{r['samples_per_s'] / 1e3:8.1f} k samples/s")
    click.echo(f"ours / torchrec: {result['ours_vs_torchrec']}; goal 20 M tokens/s met: "
               f"{result['meets_goal']}")
