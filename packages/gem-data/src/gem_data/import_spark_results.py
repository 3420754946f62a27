"""Spark's results read back by the driver: the part files Spark wrote, in order, as blocks of
exactly the rows asked for. The requests of a split (one row per request, its candidates and
history as arrays: :meth:`SparkImport._split <gem_data.import_spark.SparkImport._split>`) come
back as tables with the data set's arrow schema, ready for
:class:`~gem_data.writer.DatasetWriter` (:func:`data_set_tables`); a history tail as batches
(:mod:`gem_data.import_spark_windows`).

Spark writes a sorted result as one part file per range of the sort, numbered in the sort's
order; reading them by that number returns the rows in order, one row group at a time, so the
driver never holds more than a block. Blocks are checked to be in order all the same: a result
out of order would write a data set unlike the numpy path's. The requests of both splits come
in one result: sorted by time, train's (before the cut) come first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np


def part_files(directory: Path) -> list[Path]:
    """The part files of a result Spark wrote to ``directory``, in the order of its rows."""
    return sorted(directory.glob("part-*.parquet"), key=lambda p: int(p.name.split("-")[1]))


def blocks(paths: list[Path], rows: int, second: Callable[[Any], Any] | None = None
           ) -> Iterator[tuple[bool, Any]]:
    """The rows of ``paths``, in order, as tables of ``rows`` rows, each with whether it is of
    the second part: ``second(batch)`` says which rows are (False then True along the rows;
    None: none is). A part's last table may be shorter."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pending: list[Any] = []
    count, part = 0, False
    for path in paths:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=rows):
            starts = 0 if second is None else int(np.argmax(np.r_[second(batch), True]))
            for now, piece in ((False, batch.slice(0, starts)), (True, batch.slice(starts))):
                if not piece.num_rows:
                    continue
                if now != part and count:  # the first part ends: its last table
                    yield part, pa.Table.from_batches(pending)
                    pending, count = [], 0
                part = now
                pending.append(piece)
                count += piece.num_rows
                while count >= rows:
                    table = pa.Table.from_batches(pending)
                    yield part, table.slice(0, rows)
                    rest = table.slice(rows)
                    pending, count = rest.to_batches(), rest.num_rows
    if count:
        yield part, pa.Table.from_batches(pending)


def _lists(column: Any) -> tuple[Any, dict[str, Any]]:
    """A column of lists of structs (a null list: none) as ``(offsets, {field: values})``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    lists = _array(column)
    lengths = pc.fill_null(pc.list_value_length(lists), 0).to_numpy()
    offsets = np.zeros(lengths.size + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    structs = lists.flatten()
    return pa.array(offsets), dict(zip([f.name for f in structs.type], structs.flatten()))


def _in_order(block: Any, last: tuple[int, int] | None) -> tuple[int, int]:
    """Refuse requests out of (time, head) order; the block's last."""
    times, heads = block.column("rt").to_numpy(), block.column("head").to_numpy()
    if last is not None:
        times, heads = np.r_[last[0], times], np.r_[last[1], heads]
    step = np.diff(times)
    if (step < 0).any() or ((step == 0) & (np.diff(heads) <= 0)).any():
        raise AssertionError("Spark returned the requests out of (time, head) order")
    return int(times[-1]), int(heads[-1])


def data_set_tables(paths: list[Path], schema: Any, options: Any, rows: int,
                    cut: int | None) -> Iterator[tuple[str, Any]]:
    """The requests in ``paths`` (sorted by time and head) as ``(split, table)``: tables of
    ``rows`` requests with the data set's arrow schema (:func:`gem_data.format.arrow_schema`),
    of ``train`` then of ``eval`` (the requests at or after ``cut``; None: none)."""
    import pyarrow as pa

    from gem_data import format as fmt

    target = fmt.arrow_schema(schema)
    last = None

    def eval_rows(batch: Any) -> Any:
        times = batch.column("rt").to_numpy()
        return times >= cut if cut is not None else np.zeros(times.size, dtype=bool)

    for is_eval, block in blocks(paths, rows, eval_rows):
        last = _in_order(block, last)
        hist_offsets, hist = _lists(block.column("hist"))
        cand_offsets, cands = _lists(block.column("cands"))
        columns = {fmt.USER_ID: block.column("user_id"),
                   fmt.REQUEST_TIMESTAMP: block.column("rt"),
                   fmt.HISTORY_TIMESTAMP: pa.ListArray.from_arrays(hist_offsets, hist["t"])}
        for j, f in enumerate(schema.event_features):
            columns[fmt.event_column(f.name)] = pa.ListArray.from_arrays(hist_offsets,
                                                                         hist[f"e{j}"])
        for j, f in enumerate(schema.candidate_features):
            columns[fmt.candidate_column(f.name)] = pa.ListArray.from_arrays(cand_offsets,
                                                                             cands[f"c{j}"])
        for j, task in enumerate(schema.tasks):
            columns[fmt.label_column(task)] = pa.ListArray.from_arrays(cand_offsets,
                                                                       cands[f"l{j}"])
        width = len(options.candidate_dense_columns)
        if width:  # each candidate's values in turn
            columns[fmt.CANDIDATE_NUMERIC] = pa.ListArray.from_arrays(
                pa.array(cand_offsets.to_numpy() * width), _floats(cands, "cn", width))
        for j, f in enumerate(schema.sparse_features):
            columns[fmt.sparse_column(f.name)] = block.column(f"s{j}")
        width = len(options.dense_columns)
        if width:
            columns[fmt.DENSE] = pa.FixedSizeListArray.from_arrays(
                _floats({f"d{j}": block.column(f"d{j}") for j in range(width)}, "d", width),
                width)
        yield ("eval" if is_eval else "train",
               pa.Table.from_arrays([_array(columns[name]) for name in target.names],
                                    names=target.names).cast(target))


def _floats(columns: dict[str, Any], prefix: str, width: int) -> Any:
    """The float64 columns ``{prefix}0`` .. ``{prefix}{width - 1}``, row after row, as float32
    (rounded as numpy rounds)."""
    import pyarrow as pa

    flat = np.stack([_array(columns[f"{prefix}{j}"]).to_numpy() for j in range(width)], axis=1)
    return pa.array(flat.reshape(-1).astype(np.float32))


def _array(column: Any) -> Any:
    import pyarrow as pa

    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
