"""Columnar conversion between pyarrow tables (format 2) and :class:`~gem_core.batch.JaggedBatch`.

Both directions work on whole buffers: a list column's offsets and values become a jagged tensor's
offsets and values (zero-copy where the buffers line up), a nested list column (a multi-valued
feature) becomes a :class:`~gem_core.jagged.Jagged` over the events (or candidates) whose outer
offsets are the history's (or the candidates'); never a Python loop per row. ``uint64`` id
buffers are read as int64 with the same bits, without a copy.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from gem_core.batch import JaggedBatch
from gem_core.errors import GemDataError
from gem_core.jagged import Jagged
from gem_core.schema import FeatureSchema, SequenceFeature
from gem_data import format as fmt

_INT32_MAX = 2**31 - 1


def single_array(column: Any) -> Any:
    """One arrow Array of a column; ``combine_chunks`` copies even a single chunk, this does not."""
    if not isinstance(column, pa.ChunkedArray):
        return column
    if column.num_chunks == 1:
        return column.chunk(0)
    return column.combine_chunks()


def numpy_view(array: Any) -> np.ndarray:
    """A numpy view of a primitive arrow array's data buffer, without a copy (``uint64`` is
    viewed as ``int64``: same bits).

    Parquet readers attach a validity bitmap to list elements even when nothing is null, and
    ``to_numpy`` then copies (about 1.3 ms per million values here, a third of the loader's
    time); reading the data buffer directly avoids that. Arrays that do hold nulls are rejected
    by validation first; for them this falls back to arrow's (copying) conversion.
    """
    numeric = pa.types.is_integer(array.type) or pa.types.is_floating(array.type)
    if array.null_count or not numeric:
        return array.to_numpy(zero_copy_only=False)
    dtype = np.dtype(array.type.to_pandas_dtype())
    if dtype == np.uint64:
        dtype = np.dtype(np.int64)
    return np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array),
                         offset=array.offset * dtype.itemsize)


def list_child(array: Any) -> tuple[Any, np.ndarray]:
    """``(child, offsets)`` of a list or fixed-size list Array: the child array cut to the
    array's slice, and offsets from 0 (int64) into it."""
    if pa.types.is_fixed_size_list(array.type):
        return array.flatten(), np.arange(len(array) + 1, dtype=np.int64) * array.type.list_size
    offsets = numpy_view(array.offsets)
    start, end = int(offsets[0]), int(offsets[-1])
    if start:
        offsets = offsets - start
    return array.values.slice(start, end - start), offsets.astype(np.int64, copy=False)


def list_parts(column: Any) -> tuple[Any, np.ndarray]:
    """``(values, offsets)`` of a list column (ChunkedArray or ListArray), offsets from 0, int64.

    ``values`` is a numpy view for a list of primitives, the (sliced) child array otherwise. A
    sliced array's offsets do not start at 0 and its ``values`` is the unsliced child, so the
    values are cut to the slice; a one-chunk column costs no copy of the values.
    """
    child, offsets = list_child(single_array(column))
    return (child if pa.types.is_nested(child.type) else numpy_view(child)), offsets


def nested_list_parts(column: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(values, inner_offsets, outer_offsets)`` of a ``list<list<primitive>>`` column: the ids,
    the offsets of each inner list (an event's or candidate's ids) and the offsets of each row's
    inner lists, both from 0, int64."""
    inner, outer = list_parts(column)
    values, inner_offsets = list_parts(inner)
    return values, inner_offsets, outer


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


def gather_jagged(offsets: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Offsets of the jagged rows ``rows`` laid back to back, and the value positions that form
    them (numpy; ``offsets`` from 0)."""
    lengths = (offsets[1:] - offsets[:-1])[rows]
    new_offsets = np.zeros(rows.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_offsets[1:])
    shift = np.repeat(offsets[:-1][rows] - new_offsets[:-1], lengths)
    return new_offsets, np.arange(int(new_offsets[-1]), dtype=np.int64) + shift


def tensor_view(array: np.ndarray) -> torch.Tensor:
    # Arrow buffers are immutable, so numpy marks them read-only and torch warns on wrapping
    # them. Batches are inputs that nothing writes in place; sharing the buffer saves a copy.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def _feature_parts(table: Any, column: str, feature: SequenceFeature
                   ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """``(values, per-item offsets or None, row offsets)`` of an event or candidate column."""
    if feature.multi_valued:
        return nested_list_parts(table.column(column))
    values, offsets = list_parts(table.column(column))
    return values, None, offsets


def _ids(values: np.ndarray, inner: np.ndarray | None) -> Any:
    t = tensor_view
    return t(values) if inner is None else Jagged(t(values), t(inner))


def table_to_batch(table: Any, schema: FeatureSchema,
                   max_seq_len: int | None = None) -> JaggedBatch:
    """A JaggedBatch of every row (request) of ``table`` (already validated), histories cut to
    the most recent ``max_seq_len`` events (every event feature, multi-valued ones and
    ``history_dense`` alike)."""
    t = tensor_view
    stamps, offsets = list_parts(table.column(fmt.HISTORY_TIMESTAMP))
    events = {f.name: _feature_parts(table, fmt.event_column(f.name), f)[:2]
              for f in schema.event_features}
    seq_dense = None
    if schema.seq_dense_dim:
        flat, _ = list_parts(table.column(fmt.HISTORY_DENSE))
        seq_dense = flat.reshape(-1, schema.seq_dense_dim)
    if max_seq_len is not None:
        offsets, keep = truncate_recent(offsets, max_seq_len)
        if keep is not None:
            stamps = stamps[keep]
            seq_dense = None if seq_dense is None else seq_dense[keep]
            for name, (values, inner) in events.items():
                if inner is None:
                    events[name] = (values[keep], None)
                else:
                    inner, index = gather_jagged(inner, keep)
                    events[name] = (values[index], inner)
    candidates = {}
    candidate_offsets = None
    for f in schema.candidate_features:
        values, inner, rows = _feature_parts(table, fmt.candidate_column(f.name), f)
        candidates[f.name] = _ids(values, inner)
        if candidate_offsets is None:
            candidate_offsets = rows
    sparse = {}
    for feature in schema.sparse_features:
        values, bag_offsets = list_parts(table.column(fmt.sparse_column(feature.name)))
        sparse[feature.name] = Jagged(t(values), t(bag_offsets))

    def fixed(column: str, width: int) -> torch.Tensor:
        flat, _ = list_parts(table.column(column))
        return t(flat.reshape(-1, width))

    return JaggedBatch(
        seq_offsets=t(offsets),
        seq_timestamps=t(stamps),
        event_ids={name: _ids(values, inner) for name, (values, inner) in events.items()},
        request_timestamps=t(scalar_parts(table.column(fmt.REQUEST_TIMESTAMP))),
        candidate_offsets=t(candidate_offsets),
        candidate_ids=candidates,
        labels={task: t(list_parts(table.column(fmt.label_column(task)))[0])
                for task in schema.tasks},
        sparse=sparse,
        dense=fixed(fmt.DENSE, schema.num_dense) if schema.num_dense else None,
        seq_dense=None if seq_dense is None else t(seq_dense),
        candidate_dense=(fixed(fmt.CANDIDATE_DENSE, schema.seq_dense_dim)
                         if schema.candidate_content else None),
        candidate_numeric=(fixed(fmt.CANDIDATE_NUMERIC, schema.candidate_numeric_dim)
                           if schema.candidate_numeric_dim else None),
        user_embedding=(fixed(fmt.USER_EMBEDDING, schema.user_embedding_dim)
                        if schema.user_embedding_dim else None),
        user_ids=t(scalar_parts(table.column(fmt.USER_ID))),
        teacher_logits=({task: t(list_parts(table.column(fmt.teacher_logit_column(task)))[0])
                         for task in schema.teacher_tasks} if schema.teacher_tasks else None),
        teacher_embedding=(fixed(fmt.TEACHER_EMBEDDING, schema.teacher_embedding_dim)
                           if schema.teacher_embedding_dim else None),
    )


def _offsets32(offsets: np.ndarray, what: str) -> Any:
    if offsets.size and int(offsets[-1]) > _INT32_MAX:
        raise GemDataError(f"{what}: {int(offsets[-1])} values do not fit one arrow list array "
                           "(2^31 - 1 at most); write the data in smaller batches")
    return pa.array(offsets.astype(np.int32))


def list_array(values: np.ndarray, offsets: np.ndarray, value_type: Any, what: str = "") -> Any:
    """A ``list<value_type>`` array from numpy values and offsets (from 0)."""
    return pa.ListArray.from_arrays(_offsets32(offsets, what), pa.array(values, type=value_type))


def _ids_array(ids: Any, offsets: np.ndarray, what: str) -> Any:
    n = lambda x: x.detach().cpu().numpy()  # noqa: E731
    if isinstance(ids, Jagged):
        inner = pa.ListArray.from_arrays(_offsets32(n(ids.offsets), what),
                                         pa.array(n(ids.values), pa.int64()))
        return pa.ListArray.from_arrays(_offsets32(offsets, what), inner)
    return list_array(n(ids), offsets, pa.int64(), what)


def batch_to_table(batch: JaggedBatch, schema: FeatureSchema) -> Any:
    """The pyarrow table (in the data set's column order) holding ``batch``."""
    n = lambda x: x.detach().cpu().numpy()  # noqa: E731 - tiny local helper
    if batch.user_ids is None:
        raise GemDataError("format 2 stores a user id per request, and this batch has none "
                           "(JaggedBatch.user_ids is None); give each request its raw user key")
    offsets = n(batch.seq_offsets)
    cand_offsets = n(batch.candidate_offsets)
    columns: dict[str, Any] = {
        fmt.USER_ID: pa.array(n(batch.user_ids), pa.int64()),
        fmt.REQUEST_TIMESTAMP: pa.array(n(batch.request_timestamps), pa.int64()),
        fmt.HISTORY_TIMESTAMP: list_array(n(batch.seq_timestamps), offsets, pa.int64(),
                                          fmt.HISTORY_TIMESTAMP),
    }
    for f in schema.event_features:
        column = fmt.event_column(f.name)
        columns[column] = _ids_array(batch.event_ids[f.name], offsets, column)
    if schema.seq_dense_dim:
        columns[fmt.HISTORY_DENSE] = list_array(
            n(batch.seq_dense).reshape(-1), offsets * schema.seq_dense_dim, pa.float32(),
            fmt.HISTORY_DENSE)
    for f in schema.candidate_features:
        column = fmt.candidate_column(f.name)
        columns[column] = _ids_array(batch.candidate_ids[f.name], cand_offsets, column)
    for task in schema.tasks:
        columns[fmt.label_column(task)] = list_array(n(batch.labels[task]), cand_offsets,
                                                     pa.float32(), fmt.label_column(task))
    if schema.candidate_content:
        columns[fmt.CANDIDATE_DENSE] = list_array(
            n(batch.candidate_dense).reshape(-1), cand_offsets * schema.seq_dense_dim,
            pa.float32(), fmt.CANDIDATE_DENSE)
    if schema.candidate_numeric_dim:
        if batch.candidate_numeric is None:
            raise GemDataError("the schema has candidate numeric features and the batch has "
                               "none (JaggedBatch.candidate_numeric is None)")
        columns[fmt.CANDIDATE_NUMERIC] = list_array(
            n(batch.candidate_numeric).reshape(-1), cand_offsets * schema.candidate_numeric_dim,
            pa.float32(), fmt.CANDIDATE_NUMERIC)
    for f in schema.sparse_features:
        bag = batch.sparse[f.name]
        columns[fmt.sparse_column(f.name)] = list_array(n(bag.values), n(bag.offsets),
                                                        pa.int64(), fmt.sparse_column(f.name))
    if schema.num_dense:
        columns[fmt.DENSE] = pa.FixedSizeListArray.from_arrays(
            pa.array(n(batch.dense).reshape(-1), pa.float32()), schema.num_dense)
    if schema.user_embedding_dim:
        columns[fmt.USER_EMBEDDING] = pa.FixedSizeListArray.from_arrays(
            pa.array(n(batch.user_embedding).reshape(-1), pa.float32()),
            schema.user_embedding_dim)
    for task in schema.teacher_tasks:
        if batch.teacher_logits is None or task not in batch.teacher_logits:
            raise GemDataError(f"the schema has teacher logits of {task!r} and the batch has "
                               "none")
        columns[fmt.teacher_logit_column(task)] = list_array(
            n(batch.teacher_logits[task]), cand_offsets, pa.float32(),
            fmt.teacher_logit_column(task))
    if schema.teacher_embedding_dim:
        columns[fmt.TEACHER_EMBEDDING] = pa.FixedSizeListArray.from_arrays(
            pa.array(n(batch.teacher_embedding).reshape(-1), pa.float32()),
            schema.teacher_embedding_dim)
    return pa.Table.from_pydict(columns, schema=fmt.arrow_schema(schema))


def ids_as_int64(table: Any) -> Any:
    """``table`` with every ``uint64`` id column viewed as int64 (same bits, no copy), so files
    written by other tools with unsigned 64-bit ids read like ours."""
    changed = False
    columns = []
    fields = []
    for field, column in zip(table.schema, table.columns):
        if fmt.is_id_column(field.name) and pa.types.is_uint64(fmt.leaf_type(field.type)):
            target = fmt.with_leaf(field.type, pa.int64())
            column = pa.chunked_array([chunk.view(target) for chunk in column.chunks],
                                      type=target)
            field = field.with_type(target)
            changed = True
        columns.append(column)
        fields.append(field)
    return pa.Table.from_arrays(columns, schema=pa.schema(fields)) if changed else table
