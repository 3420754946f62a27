"""Row checks of one row group (a table of requests), with a policy per check and exact counts.

Checks (the name is the policy key in ``[data.options.validation]``):

* ``structure``: null values (at any nesting level); an event feature whose list length differs
  from ``history_timestamp``'s; ``history_dense`` not ``seq_dense_dim`` x that length; a request
  with no candidates; a candidate feature or label list whose length differs from the request's
  candidate count (``K``, the length of the first candidate feature); ``candidate_dense`` not
  ``seq_dense_dim`` x ``K``; a multi-valued event or candidate feature with an empty id list for
  some event or candidate. ``error`` or ``drop`` (the request).
* ``ids``: under a table's ``dense`` id policy, an id that is negative or not below the table's
  size (``modulo`` and ``hash`` tables take any 64-bit id). ``error``, ``drop`` the request, or
  ``clamp`` the id into ``[0, size)``.
* ``dense``: a NaN or infinite float (``dense``, ``history_dense``, ``candidate_dense``,
  ``user_embedding``). ``error``, ``drop``, or ``clamp`` (replaced by 0).
* ``labels``: a label that is not 0 or 1. ``error`` or ``drop``.
* ``time``: a history event later than its request (``history_timestamp > request_timestamp``: a
  leak of the future into the history) or earlier than ``time_floor`` (a placeholder or corrupt
  value such as -2^62): ``error``, ``drop`` the request, or ``trim`` (remove those events from
  every history column, keeping the rest). A request earlier than ``time_floor``, or a history
  whose (kept) events are not oldest first, cannot be trimmed: ``error`` or, under ``drop`` and
  ``trim``, the request is dropped.

Structure is checked first and rows it drops are gone before the value checks, so every count is
of distinct requests: a request is counted under the first check that drops it. Offsets that go
backwards or past the values cannot be repaired (the file is corrupt) and always raise. Every
error names the file, row group, row, feature and value.

The checks live one to a module: :mod:`~gem_data.validation_structure`,
:mod:`~gem_data.validation_values` (``ids``, ``dense``, ``labels``) and
:mod:`~gem_data.validation_time`; :mod:`~gem_data.validation_checker` applies the policy to the
rows they fail. This module holds the policy, the report and :func:`validate_table`, which runs
them in order.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pyarrow as pa

from gem_core.errors import GemDataError
from gem_core.schema import FeatureSchema
from gem_data import format as fmt
from gem_data.validation_checker import CHECKS, Checker, Location, ValidationPolicy
from gem_data.validation_columns import list_lengths
from gem_data.validation_structure import check_structure
from gem_data.validation_time import check_time
from gem_data.validation_values import check_dense, check_ids, check_labels


class ValidationReport:
    """Requests checked, dropped and repaired per check, and histories cut to ``max_seq_len``
    (kept: their most recent events); counted once per row group however often it is read
    (thread-safe)."""

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
                self.dropped[check] = self.dropped.get(check, 0) + count
            for check, count in repaired.items():
                self.repaired[check] = self.repaired.get(check, 0) + count

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
    """The row group with bad requests dropped or repaired per ``policy``; GemDataError
    otherwise. Histories longer than ``max_seq_len`` are counted (the reader keeps their
    recent end)."""
    check_arrays(table, where)
    n_in = table.num_rows
    table, c = _drop_malformed(table, schema, policy, where)
    # Repairs replace columns here; the table is rebuilt from them once, at the end.
    columns = {name: table.column(name) for name in table.column_names}
    replaced = check_ids(columns, schema, c)
    replaced = check_dense(columns, schema, c) or replaced
    check_labels(columns, schema, c)
    table, columns, replaced = check_time(table, columns, replaced, schema, c)

    if replaced:
        table = pa.table(columns, schema=table.schema)
    if c.drop.any():
        table = table.filter(pa.array(~c.drop))
    if report is not None:
        truncated = 0
        if max_seq_len is not None:
            truncated = int((list_lengths(table.column(fmt.HISTORY_TIMESTAMP))
                             > max_seq_len).sum())
        report.add(where, n_in, c.dropped, c.repaired, truncated)
    return table


def _drop_malformed(table: Any, schema: FeatureSchema, policy: ValidationPolicy,
                    where: Location) -> tuple[Any, Checker]:
    """The ``structure`` check, first: the table without the requests it drops, and the checker
    the value checks go on with. Those then see only well-formed requests (their messages
    still name rows of the group), and a request is counted under one check only."""
    c = Checker(policy, where, table.num_rows)
    check_structure(table, schema, c)
    row_map = None
    if c.drop.any():
        row_map = np.flatnonzero(~c.drop)
        table = table.filter(pa.array(~c.drop))
    values = Checker(policy, where, table.num_rows, row_map)
    values.dropped["structure"] = c.dropped["structure"]
    return table, values


def check_batch(batch: Any, schema: FeatureSchema, where: str = "batch") -> None:
    """Strict checks of an in-memory JaggedBatch (one built by hand or from another library):
    every offsets vector starts at 0, never goes backwards and ends at its values' length, the
    per-event, per-candidate and per-request fields have matching sizes; then gem-core's
    feature, id, label and dense checks. Raises GemDataError naming the feature, row and
    value."""
    import torch

    from gem_core.jagged import Jagged, check_offsets

    r = batch.batch_size
    events = batch.seq_timestamps.numel()
    jagged = {"history": (batch.seq_offsets, events, r)}
    jagged.update({fmt.sparse_column(k): (v.offsets, v.values.numel(), r)
                   for k, v in batch.sparse.items()})
    for kind, store in (("event", batch.event_ids), ("candidate", batch.candidate_ids)):
        for k, v in store.items():
            if isinstance(v, Jagged):
                jagged[f"{kind}.{k}"] = (v.offsets, v.values.numel(), v.batch_size)
    for name, (offsets, total, rows) in jagged.items():
        try:
            check_offsets(offsets, total, f"{where}: feature {name!r}")
        except ValueError as error:
            raise GemDataError(str(error)) from None
        if offsets.numel() - 1 != rows:
            raise GemDataError(f"{where}: feature {name!r} has {offsets.numel() - 1} rows, "
                               f"expected {rows}")
    if batch.candidate_offsets.numel() != r + 1:
        raise GemDataError(f"{where}: candidate offsets have {batch.candidate_offsets.numel()} "
                           f"entries for {r} requests (expected {r + 1})")
    for name, (tensor, size) in {"event." + k: (v, events) for k, v in batch.event_ids.items()
                                 if not isinstance(v, Jagged)}.items():
        if tensor.shape != torch.Size([size]):
            raise GemDataError(f"{where}: feature {name!r} has {tensor.numel()} values but the "
                               f"history has {size} events")
    if batch.request_timestamps.shape != torch.Size([r]):
        raise GemDataError(f"{where}: feature 'request_timestamps' has shape "
                           f"{tuple(batch.request_timestamps.shape)}, expected ({r},)")
    batch.validate(schema, where)
