"""Row checks of one row group, with a policy per check and counts of every row they touch.

Checks (the name is the policy key in ``[data.options.validation]``):

* ``structure``: null values; history columns whose lengths disagree on a row (``history_item_id``,
  ``history_action``, ``history_timestamp``, and ``history_dense`` = ``seq_dense_dim`` x length).
  ``error`` or ``drop``.
* ``ids``: an id that is negative or not below its table's size. ``error``, ``drop`` the row, or
  ``clamp`` it into ``[0, size)``.
* ``dense``: a NaN or infinite dense value. ``error``, ``drop``, or ``clamp`` (replaced by 0).
* ``labels``: a label that is not 0 or 1. ``error`` or ``drop``.

Offsets that go backwards or do not end at the values' length cannot be repaired: they mean the
file is corrupt, and :func:`check_arrays` always raises. Every error names the file, row group,
row, feature and value; every dropped or repaired row is counted in :class:`ValidationReport`.
"""

from __future__ import annotations

import threading
from typing import Any

import attrs
import numpy as np
import pyarrow as pa

from gem_core.config.validators import choice
from gem_core.errors import GemDataError
from gem_core.schema import FeatureSchema

from gem_data import format as fmt
from gem_data.arrow_io import list_parts, scalar_parts, single_array

CHECKS = ("structure", "ids", "dense", "labels")


@attrs.frozen(kw_only=True)
class ValidationPolicy:
    """What to do with a row that fails a check (``[data.options.validation]``)."""

    structure: str = attrs.field(default="error", validator=choice("error", "drop"))
    """Nulls or history columns of different lengths on a row: ``error`` or ``drop``."""

    ids: str = attrs.field(default="error", validator=choice("error", "drop", "clamp"))
    """An id outside ``[0, size)``: ``error``, ``drop`` the row, or ``clamp`` the id."""

    dense: str = attrs.field(default="error", validator=choice("error", "drop", "clamp"))
    """A NaN or infinite dense value: ``error``, ``drop`` the row, or ``clamp`` it to 0."""

    labels: str = attrs.field(default="error", validator=choice("error", "drop"))
    """A label other than 0 or 1: ``error`` or ``drop`` the row."""


@attrs.frozen(kw_only=True)
class Location:
    """Where a row group lives, for error messages."""

    file: str
    row_group: int
    first_row: int
    """Index within the file of the row group's first row."""

    def row(self, row: int) -> str:
        return (f"{self.file}: row group {self.row_group}, row {self.first_row + row} "
                f"(row {row} of the group)")


class ValidationReport:
    """Rows checked, dropped and repaired per check, and histories cut to ``max_seq_len`` (kept:
    their most recent events); counted once per row group however often it is read (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: set[tuple[str, int]] = set()
        self.rows_checked = 0
        self.truncated = 0
        self.dropped = dict.fromkeys(CHECKS, 0)
        self.repaired = dict.fromkeys(CHECKS, 0)

    def add(self, where: Location, rows: int, dropped: dict[str, int],
            repaired: dict[str, int], truncated: int = 0) -> None:
        with self._lock:
            key = (where.file, where.row_group)
            if key in self._seen:  # a second epoch reads the same row group again
                return
            self._seen.add(key)
            self.rows_checked += rows
            self.truncated += truncated
            for check, count in dropped.items():
                self.dropped[check] += count
            for check, count in repaired.items():
                self.repaired[check] += count

    def to_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"rows_checked": self.rows_checked, "rows_dropped": dict(self.dropped),
                    "rows_repaired": dict(self.repaired),
                    "total_dropped": sum(self.dropped.values()),
                    "total_repaired": sum(self.repaired.values()),
                    "histories_truncated": self.truncated}


def check_arrays(table: Any, where: Location) -> None:
    """Structural validity of every column's buffers (offsets monotonic and within the values)."""
    for name in table.column_names:
        for chunk in table.column(name).chunks:
            try:
                chunk.validate(full=True)
            except pa.ArrowInvalid as error:
                raise GemDataError(f"{where.file}: row group {where.row_group}: feature {name!r}: "
                                   f"corrupt column ({error})") from None


def validate_table(table: Any, schema: FeatureSchema, policy: ValidationPolicy,
                   where: Location, report: ValidationReport | None = None,
                   max_seq_len: int | None = None) -> Any:
    """The row group with bad rows dropped or repaired per ``policy``; GemDataError otherwise.
    Histories longer than ``max_seq_len`` are counted (the reader keeps their recent end)."""
    check_arrays(table, where)
    n = table.num_rows
    drop = np.zeros(n, dtype=bool)
    dropped = dict.fromkeys(CHECKS, 0)
    repaired = dict.fromkeys(CHECKS, 0)

    def reject(check: str, rows: np.ndarray, describe: Any) -> None:
        """Raise for the first bad row under ``error``; else mark the rows to drop and count them.
        ``describe(row)`` words the feature and value of that row."""
        mode = getattr(policy, check)
        if mode == "error":
            row = int(np.flatnonzero(rows)[0])
            raise GemDataError(f"{where.row(row)}: {describe(row)} "
                               f"({int(rows.sum())} such rows in the group; "
                               f"data.options.validation.{check} = 'error')")
        dropped[check] += int((rows & ~drop).sum())
        drop[:] |= rows

    for name in table.column_names:
        column = table.column(name)
        if column.null_count:
            nulls = np.asarray(column.is_null(), dtype=bool)
            reject("structure", nulls, lambda row, name=name: f"feature {name!r} value null")
        if pa.types.is_list(column.type) or pa.types.is_fixed_size_list(column.type):
            flat = single_array(column).flatten()  # the values of the rows, in row order
            if flat.null_count:
                _, offsets = list_parts(column)
                rows = _rows_of(np.asarray(flat.is_null(), dtype=bool), offsets, n)
                reject("structure", rows,
                       lambda row, name=name: f"feature {name!r} has a null value in its list")

    item_offsets = list_parts(table.column(fmt.HISTORY_ITEM))[1]
    item_lengths = np.diff(item_offsets)
    for name in fmt.HISTORY_ID_COLUMNS[1:] + ((fmt.HISTORY_DENSE,) if schema.seq_dense_dim else ()):
        width = schema.seq_dense_dim if name == fmt.HISTORY_DENSE else 1
        offsets = list_parts(table.column(name))[1]
        if width == 1 and np.array_equal(offsets, item_offsets):
            continue  # one pass over the offsets, no temporaries, in the common case
        lengths = np.diff(offsets)
        bad = lengths != item_lengths * width
        if bad.any():
            reject("structure", bad, lambda row, name=name, lengths=lengths, width=width: (
                f"feature {name!r} has {int(lengths[row])} values where {fmt.HISTORY_ITEM!r} "
                f"length {int(item_lengths[row])} needs {int(item_lengths[row]) * width}"))

    columns = {name: table.column(name) for name in table.column_names}
    for name, size in fmt.id_spaces(schema).items():
        column = columns[name]
        is_list = pa.types.is_list(column.type)
        values, offsets = list_parts(column) if is_list else (_scalars(column), None)
        # Fast path: two reductions and no temporaries when every id is in range (the norm).
        if values.size == 0 or (values.min() >= 0 and values.max() < size):
            continue
        bad_values = (values < 0) | (values >= size)
        rows = _rows_of(bad_values, offsets, n)
        first = int(np.flatnonzero(bad_values)[0])
        if policy.ids == "clamp":
            repaired["ids"] += int((rows & ~drop).sum())
            clipped = np.clip(values, 0, size - 1)
            columns[name] = (pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)),
                                                      pa.array(clipped)) if is_list
                             else pa.array(clipped))
        else:
            reject("ids", rows, lambda row, name=name, v=int(values[first]), size=size: (
                f"feature {name!r} value {v} is outside [0, {size})"))

    fixed_width = (fmt.DENSE, fmt.USER_EMBEDDING, fmt.CANDIDATE_DENSE)
    for name, width in ((fmt.DENSE, schema.num_dense), (fmt.HISTORY_DENSE, schema.seq_dense_dim),
                        (fmt.CANDIDATE_DENSE, schema.seq_dense_dim * schema.candidate_content),
                        (fmt.USER_EMBEDDING, schema.user_embedding_dim)):
        if not width:
            continue
        values, offsets = list_parts(columns[name])
        bad_values = ~np.isfinite(values)
        if not bad_values.any():
            continue
        rows = _rows_of(bad_values, offsets, n)
        first = float(values[np.flatnonzero(bad_values)[0]])
        if policy.dense == "clamp":
            repaired["dense"] += int((rows & ~drop).sum())
            fixed = pa.array(np.where(bad_values, np.float32(0), values), pa.float32())
            columns[name] = (pa.FixedSizeListArray.from_arrays(fixed, width)
                             if name in fixed_width
                             else pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)),
                                                           fixed))
        else:
            reject("dense", rows, lambda row, name=name, v=first: (
                f"feature {name!r} value {v} is not finite"))

    for task in schema.tasks:
        label = _scalars(columns[fmt.label_column(task)])
        bad = ~((label == 0) | (label == 1))
        if bad.any():
            reject("labels", bad, lambda row, task=task, label=label: (
                f"feature {fmt.label_column(task)!r} value {float(label[row])} is not 0 or 1"))

    if any(repaired.values()):
        table = pa.table(columns, schema=table.schema)
    if drop.any():
        table = table.filter(pa.array(~drop))
    if report is not None:
        truncated = 0 if max_seq_len is None else int((item_lengths[~drop] > max_seq_len).sum())
        report.add(where, n, dropped, repaired, truncated)
    return table


def _scalars(column: Any) -> np.ndarray:
    return scalar_parts(column)


def _rows_of(bad_values: np.ndarray, offsets: np.ndarray | None, n: int) -> np.ndarray:
    """Per row, whether it holds a bad value (values are per row when ``offsets`` is None,
    else laid out by ``offsets``; a fixed-size list has implicit offsets)."""
    if offsets is None:
        return bad_values
    positions = np.flatnonzero(bad_values)
    rows = np.searchsorted(offsets, positions, side="right") - 1
    out = np.zeros(n, dtype=bool)
    out[rows] = True
    return out


def check_batch(batch: Any, schema: FeatureSchema, where: str = "batch") -> None:
    """Strict checks of an in-memory JaggedBatch (one built by hand or from another library):
    every offsets vector starts at 0, never goes backwards and ends at its values' length, the
    per-event and per-sample fields have matching sizes; then gem-core's id, label and dense
    checks. Raises GemDataError naming the feature, row and value."""
    import torch

    from gem_core.jagged import check_offsets

    jagged = {"history": (batch.seq_offsets, batch.seq_item_ids.numel())}
    jagged.update({f"sparse.{k}": (v.offsets, v.values.numel()) for k, v in batch.sparse.items()})
    for name, (offsets, total) in jagged.items():
        try:
            check_offsets(offsets, total, f"{where}: feature {name!r}")
        except ValueError as error:
            raise GemDataError(str(error)) from None
        if offsets.numel() - 1 != batch.batch_size:
            raise GemDataError(f"{where}: feature {name!r} has {offsets.numel() - 1} rows, "
                               f"the batch has {batch.batch_size}")
    events = batch.seq_item_ids.numel()
    for name in ("seq_action_ids", "seq_timestamps"):
        if getattr(batch, name).numel() != events:
            raise GemDataError(f"{where}: feature {name!r} has {getattr(batch, name).numel()} "
                               f"values but the history has {events} events")
    per_sample = {"request_timestamps": batch.request_timestamps,
                  "candidate_item_ids": batch.candidate_item_ids, **batch.candidate_sparse}
    for name, tensor in per_sample.items():
        if tensor.shape != torch.Size([batch.batch_size]):
            raise GemDataError(f"{where}: feature {name!r} has shape {tuple(tensor.shape)}, "
                               f"expected ({batch.batch_size},)")
    batch.validate(schema, where)
