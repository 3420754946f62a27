"""Columnar conversion between pyarrow tables and :class:`~gem_core.batch.JaggedBatch`.

Both directions work on whole buffers: a list column's offsets and values become a jagged tensor's
offsets and values (zero-copy where the buffers line up), never a Python loop per row.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from gem_core.batch import JaggedBatch
from gem_core.jagged import Jagged
from gem_core.schema import FeatureSchema

from gem_data import format as fmt


def single_array(column: Any) -> Any:
    """One arrow Array of a column; ``combine_chunks`` copies even a single chunk, this does not."""
    if not isinstance(column, pa.ChunkedArray):
        return column
    if column.num_chunks == 1:
        return column.chunk(0)
    return column.combine_chunks()


def numpy_view(array: Any) -> np.ndarray:
    """A numpy view of a primitive arrow array's data buffer, without a copy.

    Parquet readers attach a validity bitmap to list elements even when nothing is null, and
    ``to_numpy`` then copies (about 1.3 ms per million values here, a third of the loader's
    time); reading the data buffer directly avoids that. Arrays that do hold nulls are rejected
    by validation first; for them this falls back to arrow's (copying) conversion.
    """
    if array.null_count or not (pa.types.is_integer(array.type) or pa.types.is_floating(array.type)):
        return array.to_numpy(zero_copy_only=False)
    dtype = np.dtype(array.type.to_pandas_dtype())
    return np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array),
                         offset=array.offset * dtype.itemsize)


def list_parts(column: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(values, offsets)`` of a list column (ChunkedArray or ListArray), offsets from 0, int64.

    A sliced array's offsets do not start at 0 and its ``values`` is the unsliced child, so the
    values are cut to the slice; a one-chunk column costs no copy of the values.
    """
    array = single_array(column)
    if pa.types.is_fixed_size_list(array.type):
        width = array.type.list_size
        values = numpy_view(array.flatten())
        return values, np.arange(len(array) + 1, dtype=np.int64) * width
    offsets = numpy_view(array.offsets)
    start, end = int(offsets[0]), int(offsets[-1])
    values = numpy_view(array.values.slice(start, end - start))
    if start:
        offsets = offsets - start
    return values, offsets.astype(np.int64, copy=False)


def scalar_parts(column: Any) -> np.ndarray:
    return numpy_view(single_array(column))


def truncate_recent(offsets: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Keep each row's last ``max_len`` events: new offsets and the kept value positions
    (None when no row is longer, so the caller can keep the buffers as they are)."""
    lengths = np.diff(offsets)
    if lengths.size == 0 or int(lengths.max()) <= max_len:
        return offsets, None
    kept = np.minimum(lengths, max_len)
    new_offsets = np.zeros_like(offsets)
    np.cumsum(kept, out=new_offsets[1:])
    # Position j of output row b reads input position offsets[b+1] - kept[b] + j.
    shift = np.repeat(offsets[1:] - kept - new_offsets[:-1], kept)
    return new_offsets, np.arange(int(new_offsets[-1]), dtype=np.int64) + shift


def tensor_view(array: np.ndarray) -> torch.Tensor:
    # Arrow buffers are immutable, so numpy marks them read-only and torch warns on wrapping
    # them. Batches are inputs that nothing writes in place; sharing the buffer saves a copy.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def table_to_batch(table: Any, schema: FeatureSchema, max_seq_len: int | None = None) -> JaggedBatch:
    """A JaggedBatch of every row of ``table`` (already validated), histories cut to the most
    recent ``max_seq_len`` events."""
    t = tensor_view
    items, offsets = list_parts(table.column(fmt.HISTORY_ITEM))
    actions, _ = list_parts(table.column(fmt.HISTORY_ACTION))
    stamps, _ = list_parts(table.column(fmt.HISTORY_TIMESTAMP))
    seq_dense = None
    if schema.seq_dense_dim:
        flat, _ = list_parts(table.column(fmt.HISTORY_DENSE))
        seq_dense = flat.reshape(-1, schema.seq_dense_dim)
    if max_seq_len is not None:
        offsets, keep = truncate_recent(offsets, max_seq_len)
        if keep is not None:
            items, actions, stamps = items[keep], actions[keep], stamps[keep]
            seq_dense = None if seq_dense is None else seq_dense[keep]
    sparse = {}
    for feature in schema.sparse_features:
        values, bag_offsets = list_parts(table.column(fmt.sparse_column(feature.name)))
        sparse[feature.name] = Jagged(t(values), t(bag_offsets))
    dense = None
    if schema.num_dense:
        flat, _ = list_parts(table.column(fmt.DENSE))
        dense = t(flat.reshape(-1, schema.num_dense))
    candidate_dense = None
    if schema.candidate_content:
        flat, _ = list_parts(table.column(fmt.CANDIDATE_DENSE))
        candidate_dense = t(flat.reshape(-1, schema.seq_dense_dim))
    user_embedding = None
    if schema.user_embedding_dim:
        flat, _ = list_parts(table.column(fmt.USER_EMBEDDING))
        user_embedding = t(flat.reshape(-1, schema.user_embedding_dim))
    return JaggedBatch(
        seq_offsets=t(offsets),
        seq_item_ids=t(items),
        seq_action_ids=t(actions),
        seq_timestamps=t(stamps),
        request_timestamps=t(scalar_parts(table.column(fmt.REQUEST_TIMESTAMP))),
        candidate_item_ids=t(scalar_parts(table.column(fmt.CANDIDATE_ITEM))),
        labels={task: t(scalar_parts(table.column(fmt.label_column(task))))
                for task in schema.tasks},
        sparse=sparse,
        candidate_sparse={f.name: t(scalar_parts(table.column(fmt.candidate_column(f.name))))
                          for f in schema.candidate_features},
        dense=dense,
        seq_dense=None if seq_dense is None else t(seq_dense),
        candidate_dense=candidate_dense,
        user_embedding=user_embedding,
    )


def _list_array(values: np.ndarray, offsets: np.ndarray, value_type: Any) -> Any:
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)),
                                    pa.array(values, type=value_type))


def batch_to_table(batch: JaggedBatch, schema: FeatureSchema) -> Any:
    """The pyarrow table (in the data set's column order) holding ``batch``."""
    n = lambda x: x.detach().cpu().numpy()  # noqa: E731 - tiny local helper
    offsets = n(batch.seq_offsets)
    columns: dict[str, Any] = {
        fmt.HISTORY_ITEM: _list_array(n(batch.seq_item_ids), offsets, pa.int64()),
        fmt.HISTORY_ACTION: _list_array(n(batch.seq_action_ids), offsets, pa.int64()),
        fmt.HISTORY_TIMESTAMP: _list_array(n(batch.seq_timestamps), offsets, pa.int64()),
    }
    if schema.seq_dense_dim:
        columns[fmt.HISTORY_DENSE] = _list_array(
            n(batch.seq_dense).reshape(-1), offsets * schema.seq_dense_dim, pa.float32())
    columns[fmt.REQUEST_TIMESTAMP] = pa.array(n(batch.request_timestamps), pa.int64())
    columns[fmt.CANDIDATE_ITEM] = pa.array(n(batch.candidate_item_ids), pa.int64())
    for f in schema.candidate_features:
        columns[fmt.candidate_column(f.name)] = pa.array(n(batch.candidate_sparse[f.name]),
                                                         pa.int64())
    for f in schema.sparse_features:
        bag = batch.sparse[f.name]
        columns[fmt.sparse_column(f.name)] = _list_array(n(bag.values), n(bag.offsets), pa.int64())
    if schema.num_dense:
        columns[fmt.DENSE] = pa.FixedSizeListArray.from_arrays(
            pa.array(n(batch.dense).reshape(-1), pa.float32()), schema.num_dense)
    for task in schema.tasks:
        columns[fmt.label_column(task)] = pa.array(n(batch.labels[task]), pa.float32())
    if schema.candidate_content:
        columns[fmt.CANDIDATE_DENSE] = pa.FixedSizeListArray.from_arrays(
            pa.array(n(batch.candidate_dense).reshape(-1), pa.float32()), schema.seq_dense_dim)
    if schema.user_embedding_dim:
        columns[fmt.USER_EMBEDDING] = pa.FixedSizeListArray.from_arrays(
            pa.array(n(batch.user_embedding).reshape(-1), pa.float32()),
            schema.user_embedding_dim)
    return pa.Table.from_pydict(columns, schema=fmt.arrow_schema(schema))
