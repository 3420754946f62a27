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
"""

from __future__ import annotations

import datetime
import threading
from typing import Any, Callable

import attrs
import numpy as np
import pyarrow as pa

from gem_core.config.validators import choice
from gem_core.errors import GemDataError
from gem_core.schema import FeatureSchema
from gem_data import format as fmt
from gem_data.arrow_io import (
    gather_jagged,
    list_array,
    list_child,
    list_parts,
    nested_list_parts,
    scalar_parts,
    single_array,
)

CHECKS = ("structure", "ids", "dense", "labels", "time")


@attrs.frozen(kw_only=True)
class ValidationPolicy:
    """What to do with a request that fails a check (``[data.options.validation]``)."""

    structure: str = attrs.field(default="error", validator=choice("error", "drop"))
    """Nulls, lists of disagreeing lengths, no candidates, empty multi-valued id lists:
    ``error`` or ``drop``."""

    ids: str = attrs.field(default="error", validator=choice("error", "drop", "clamp"))
    """An id outside ``[0, size)`` of a ``dense``-policy table: ``error``, ``drop`` the
    request, or ``clamp`` the id."""

    dense: str = attrs.field(default="error", validator=choice("error", "drop", "clamp"))
    """A NaN or infinite dense value: ``error``, ``drop`` the request, or ``clamp`` it to 0."""

    labels: str = attrs.field(default="error", validator=choice("error", "drop"))
    """A label other than 0 or 1: ``error`` or ``drop`` the request."""

    time: str = attrs.field(default="error", validator=choice("error", "drop", "trim"))
    """A history event after its request or before ``time_floor``: ``error``, ``drop`` the
    request, or ``trim`` those events from the history. A request before ``time_floor`` or a
    history out of order is an error under ``error`` and dropped otherwise."""

    time_floor: int = attrs.field(default=0, validator=attrs.validators.instance_of(int))
    """Earliest plausible time, in the data's seconds since 1970-01-01 UTC: requests and events
    before it fail the ``time`` check (-2^62 and other placeholders). The default, 0, accepts
    any time from 1970 on; ``631152000`` is 1990-01-01. Data sets with relative times (seconds
    from the start of a log) keep 0."""


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


# -- helpers over (values, offsets chain) --------------------------------------------------------

def _leaf(column: Any) -> tuple[np.ndarray, list[np.ndarray], str]:
    """``(values, chain, kind)``: the column's primitive values and the offsets from rows down
    to them (``[]`` scalar, ``[offsets]`` list or fixed-size list, ``[outer, inner]`` nested)."""
    typ = column.type
    if pa.types.is_list(typ) and pa.types.is_list(typ.value_type):
        values, inner, outer = nested_list_parts(column)
        return values, [outer, inner], "nested"
    if pa.types.is_list(typ) or pa.types.is_fixed_size_list(typ):
        values, offsets = list_parts(column)
        return values, [offsets], "fixed" if pa.types.is_fixed_size_list(typ) else "list"
    return scalar_parts(column), [], "scalar"


def _owners(positions: np.ndarray, chain: list[np.ndarray]) -> np.ndarray:
    """The row of each value position, through the offsets chain."""
    for offsets in reversed(chain):
        positions = np.searchsorted(offsets, positions, side="right") - 1
    return positions


def _rows_mask(positions: np.ndarray, chain: list[np.ndarray], n: int) -> np.ndarray:
    mask = np.zeros(n, dtype=bool)
    mask[_owners(positions, chain)] = True
    return mask


def _rebuild(column: Any, values: np.ndarray, chain: list[np.ndarray], kind: str) -> Any:
    """A column of the same type and offsets as ``column`` with new primitive ``values``."""
    leaf = fmt.leaf_type(column.type)
    array = pa.array(values, type=leaf)
    if kind == "scalar":
        return array
    if kind == "fixed":
        return pa.FixedSizeListArray.from_arrays(array, column.type.list_size)
    if kind == "nested":
        inner = pa.ListArray.from_arrays(pa.array(chain[1].astype(np.int32)), array)
        return pa.ListArray.from_arrays(pa.array(chain[0].astype(np.int32)), inner)
    return pa.ListArray.from_arrays(pa.array(chain[0].astype(np.int32)), array)


def _lengths(column: Any) -> np.ndarray:
    return np.diff(list_child(single_array(column))[1])


class _Checker:
    """The state of one row group's validation: drop mask, counts, and error wording."""

    def __init__(self, policy: ValidationPolicy, where: Location, n: int,
                 row_map: np.ndarray | None = None) -> None:
        self.policy, self.where, self.n = policy, where, n
        self.row_map = row_map
        self.drop = np.zeros(n, dtype=bool)
        self.dropped = dict.fromkeys(CHECKS, 0)
        self.repaired = dict.fromkeys(CHECKS, 0)

    def original(self, row: int) -> int:
        return row if self.row_map is None else int(self.row_map[row])

    def reject(self, check: str, rows: np.ndarray, describe: Callable[[int], str]) -> None:
        """Raise for the first bad row under ``error``; else mark the rows to drop and count
        them. ``describe(row)`` words the feature and value of that row."""
        mode = getattr(self.policy, check)
        if mode == "error":
            row = int(np.flatnonzero(rows)[0])
            raise GemDataError(f"{self.where.row(self.original(row))}: {describe(row)} "
                               f"({int(rows.sum())} such rows in the group; "
                               f"data.options.validation.{check} = 'error')")
        self.dropped[check] += int((rows & ~self.drop).sum())
        self.drop |= rows

    def repair(self, check: str, rows: np.ndarray) -> None:
        self.repaired[check] += int((rows & ~self.drop).sum())


def _check_structure(table: Any, schema: FeatureSchema, c: _Checker) -> None:
    n = table.num_rows
    for name in table.column_names:
        level, chain = single_array(table.column(name)), []
        while True:
            if level.null_count:
                positions = np.flatnonzero(np.asarray(level.is_null(), dtype=bool))
                c.reject("structure", _rows_mask(positions, chain, n),
                         lambda row, name=name: f"feature {name!r} value null")
            if not (pa.types.is_list(level.type) or pa.types.is_fixed_size_list(level.type)):
                break
            level, offsets = list_child(level)
            chain.append(offsets)

    history = _lengths(table.column(fmt.HISTORY_TIMESTAMP))
    hist_offsets = list_child(single_array(table.column(fmt.HISTORY_TIMESTAMP)))[1]

    def same_length(name: str, lengths: np.ndarray, expected: np.ndarray, what: str,
                    width: int = 1) -> None:
        bad = lengths != expected * width
        if bad.any():
            c.reject("structure", bad, lambda row: (
                f"feature {name!r} has {int(lengths[row])} values where {what} "
                f"{int(expected[row])}" + (f" needs {int(expected[row]) * width}"
                                           if width != 1 else "")))

    def non_empty(name: str, column: Any, kind: str) -> None:
        inner = list_child(list_child(single_array(column))[0])[1]
        empty = np.diff(inner) == 0
        if empty.any():
            outer = list_child(single_array(column))[1]
            rows = _rows_mask(np.flatnonzero(empty), [outer], n)

            def describe(row: int) -> str:
                first = int(np.flatnonzero(empty[outer[row]:outer[row + 1]])[0])
                return (f"feature {name!r} has an empty id list for {kind} {first} of the row "
                        f"(a multi-valued {kind} feature needs at least one id per {kind})")
            c.reject("structure", rows, describe)

    for f in schema.event_features:
        name = fmt.event_column(f.name)
        column = table.column(name)
        offsets = list_child(single_array(column))[1]
        if not np.array_equal(offsets, hist_offsets):
            same_length(name, np.diff(offsets), history,
                        f"{fmt.HISTORY_TIMESTAMP!r} has")
        if f.multi_valued:
            non_empty(name, column, "event")
    if schema.seq_dense_dim:
        same_length(fmt.HISTORY_DENSE, _lengths(table.column(fmt.HISTORY_DENSE)), history,
                    f"{fmt.HISTORY_TIMESTAMP!r} length", schema.seq_dense_dim)

    first = schema.candidate_features[0]
    first_name = fmt.candidate_column(first.name)
    first_offsets = list_child(single_array(table.column(first_name)))[1]
    counts = np.diff(first_offsets)
    none = counts == 0
    if none.any():
        c.reject("structure", none, lambda row: (
            f"the request has no candidates (feature {first_name!r} is an empty list; every "
            "request needs at least one)"))
    what = f"the request's candidate count ({first_name!r}) is"
    for f in schema.candidate_features:
        name = fmt.candidate_column(f.name)
        column = table.column(name)
        offsets = list_child(single_array(column))[1]
        if name != first_name and not np.array_equal(offsets, first_offsets):
            same_length(name, np.diff(offsets), counts, what)
        if f.multi_valued:
            non_empty(name, column, "candidate")
    for task in schema.tasks:
        name = fmt.label_column(task)
        offsets = list_child(single_array(table.column(name)))[1]
        if not np.array_equal(offsets, first_offsets):
            same_length(name, np.diff(offsets), counts, what)
    if schema.candidate_content:
        same_length(fmt.CANDIDATE_DENSE, _lengths(table.column(fmt.CANDIDATE_DENSE)), counts,
                    what, schema.seq_dense_dim)
    for task in schema.teacher_tasks:  # gem distill-precompute: one teacher logit a candidate
        name = fmt.teacher_logit_column(task)
        same_length(name, _lengths(table.column(name)), counts, what)


def _trim_events(table: Any, schema: FeatureSchema, keep: np.ndarray) -> Any:
    """``table`` with only the history events ``keep`` (a mask over all events), in every
    history column."""
    stamps, offsets = list_parts(table.column(fmt.HISTORY_TIMESTAMP))
    rows = np.repeat(np.arange(table.num_rows), np.diff(offsets))
    kept = np.bincount(rows[keep], minlength=table.num_rows)
    new_offsets = np.zeros(table.num_rows + 1, dtype=np.int64)
    np.cumsum(kept, out=new_offsets[1:])
    index = np.flatnonzero(keep)
    columns = {name: table.column(name) for name in table.column_names}
    columns[fmt.HISTORY_TIMESTAMP] = list_array(stamps[index], new_offsets, pa.int64())
    for f in schema.event_features:
        name = fmt.event_column(f.name)
        if f.multi_valued:
            values, inner, _ = nested_list_parts(table.column(name))
            inner, value_index = gather_jagged(inner, index)
            columns[name] = _rebuild(table.column(name), values[value_index],
                                     [new_offsets, inner], "nested")
        else:
            values, _ = list_parts(table.column(name))
            columns[name] = list_array(values[index], new_offsets, pa.int64())
    if schema.seq_dense_dim:
        flat, _ = list_parts(table.column(fmt.HISTORY_DENSE))
        d = schema.seq_dense_dim
        columns[fmt.HISTORY_DENSE] = list_array(flat.reshape(-1, d)[index].reshape(-1),
                                                new_offsets * d, pa.float32())
    return pa.table(columns, schema=table.schema)


def validate_table(table: Any, schema: FeatureSchema, policy: ValidationPolicy,
                   where: Location, report: ValidationReport | None = None,
                   max_seq_len: int | None = None) -> Any:
    """The row group with bad requests dropped or repaired per ``policy``; GemDataError
    otherwise. Histories longer than ``max_seq_len`` are counted (the reader keeps their
    recent end)."""
    check_arrays(table, where)
    n_in = table.num_rows
    c = _Checker(policy, where, n_in)
    _check_structure(table, schema, c)
    row_map = None
    if c.drop.any():  # value checks then see only well-formed requests
        row_map = np.flatnonzero(~c.drop)
        table = table.filter(pa.array(~c.drop))
    structure_dropped = dict(c.dropped)
    c = _Checker(policy, where, table.num_rows, row_map)
    c.dropped["structure"] = structure_dropped["structure"]
    n = table.num_rows
    columns = {name: table.column(name) for name in table.column_names}
    replaced = False

    for name, _kind, feature in fmt.id_columns(schema):
        table_spec = schema.table(feature.table)
        if table_spec.id_policy != "dense":
            continue
        size = table_spec.num_embeddings
        values, chain, shape = _leaf(columns[name])
        # Fast path: two reductions and no temporaries when every id is in range (the norm).
        if values.size == 0 or (values.min() >= 0 and values.max() < size):
            continue
        bad_values = (values < 0) | (values >= size)
        positions = np.flatnonzero(bad_values)
        rows = _rows_mask(positions, chain, n)
        if policy.ids == "clamp":
            c.repair("ids", rows)
            columns[name] = _rebuild(columns[name], np.clip(values, 0, size - 1), chain, shape)
            replaced = True
            continue
        owners = _owners(positions, chain)

        def describe(row: int, name=name, values=values, positions=positions, owners=owners,
                     size=size, table_name=table_spec.name) -> str:
            value = int(values[positions[np.flatnonzero(owners == row)[0]]])
            return (f"feature {name!r} value {value} is outside [0, {size}) of table "
                    f"{table_name!r} (id_policy 'dense')")
        c.reject("ids", rows, describe)

    for name, width in ((fmt.DENSE, schema.num_dense), (fmt.HISTORY_DENSE, schema.seq_dense_dim),
                        (fmt.CANDIDATE_DENSE, schema.seq_dense_dim * schema.candidate_content),
                        (fmt.USER_EMBEDDING, schema.user_embedding_dim),
                        (fmt.TEACHER_EMBEDDING, schema.teacher_embedding_dim),
                        *((fmt.teacher_logit_column(t), 1) for t in schema.teacher_tasks)):
        if not width:
            continue
        values, chain, shape = _leaf(columns[name])
        bad_values = ~np.isfinite(values)
        if not bad_values.any():
            continue
        positions = np.flatnonzero(bad_values)
        rows = _rows_mask(positions, chain, n)
        if policy.dense == "clamp":
            c.repair("dense", rows)
            columns[name] = _rebuild(columns[name], np.where(bad_values, np.float32(0), values),
                                     chain, shape)
            replaced = True
            continue
        owners = _owners(positions, chain)
        c.reject("dense", rows, lambda row, name=name, values=values, positions=positions,
                 owners=owners: (f"feature {name!r} value "
                                 f"{float(values[positions[np.flatnonzero(owners == row)[0]]])} "
                                 "is not finite"))

    for task in schema.tasks:
        name = fmt.label_column(task)
        values, chain, _ = _leaf(columns[name])
        bad_values = ~((values == 0) | (values == 1))
        if bad_values.any():
            positions = np.flatnonzero(bad_values)
            owners = _owners(positions, chain)
            c.reject("labels", _rows_mask(positions, chain, n),
                     lambda row, name=name, values=values, positions=positions, owners=owners,
                     offsets=chain[0]: (
                         f"feature {name!r} value "
                         f"{float(values[positions[np.flatnonzero(owners == row)[0]]])} of "
                         "candidate "
                         f"{int(positions[np.flatnonzero(owners == row)[0]]) - int(offsets[row])}"
                         " is not 0 or 1"))

    table, columns, replaced = _check_time(table, columns, replaced, schema, policy, c)

    if replaced:
        table = pa.table(columns, schema=table.schema)
    if c.drop.any():
        table = table.filter(pa.array(~c.drop))
    if report is not None:
        truncated = 0
        if max_seq_len is not None:
            truncated = int((_lengths(table.column(fmt.HISTORY_TIMESTAMP)) > max_seq_len).sum())
        report.add(where, n_in, c.dropped, c.repaired, truncated)
    return table


def _utc(seconds: int) -> str:
    """``seconds`` as a UTC date for messages (``?`` when outside what a date can hold)."""
    try:
        return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, OSError, ValueError):
        return "not a representable date"


def _check_time(table: Any, columns: dict[str, Any], replaced: bool, schema: FeatureSchema,
                policy: ValidationPolicy, c: _Checker) -> tuple[Any, dict[str, Any], bool]:
    """The ``time`` check: requests before the floor; history events after their request or
    before the floor (trimmed under ``trim``); histories whose remaining events go back in
    time. Returns the (possibly trimmed) table, its columns and whether columns still differ
    from the table."""
    n, floor = table.num_rows, policy.time_floor
    stamps, hist_offsets = list_parts(columns[fmt.HISTORY_TIMESTAMP])
    request = scalar_parts(columns[fmt.REQUEST_TIMESTAMP])
    early_requests = request < floor
    if early_requests.any():
        c.reject("time", early_requests, lambda row: (
            f"feature {fmt.REQUEST_TIMESTAMP!r} value {int(request[row])} "
            f"({_utc(int(request[row]))}) is before data.options.validation.time_floor "
            f"{floor} ({_utc(floor)})"))
    if not stamps.size:
        return table, columns, replaced
    event_rows = np.repeat(np.arange(n), np.diff(hist_offsets))
    future = stamps > request[event_rows]
    early = stamps < floor

    def first_event(mask: np.ndarray, row: int) -> int:
        start, end = int(hist_offsets[row]), int(hist_offsets[row + 1])
        return int(np.flatnonzero(mask[start:end])[0])

    def rows_of(mask: np.ndarray) -> np.ndarray:
        rows = np.zeros(n, dtype=bool)
        rows[event_rows[mask]] = True
        return rows

    if policy.time != "trim":
        if future.any():
            def describe_future(row: int) -> str:
                event = first_event(future, row)
                return (f"feature {fmt.HISTORY_TIMESTAMP!r} value "
                        f"{int(stamps[hist_offsets[row] + event])} of event {event} is after "
                        f"the request's {fmt.REQUEST_TIMESTAMP!r} {int(request[row])} (history "
                        "events must not be later than their request)")
            c.reject("time", rows_of(future), describe_future)
        if early.any():
            def describe_early(row: int) -> str:
                event = first_event(early, row)
                value = int(stamps[hist_offsets[row] + event])
                return (f"feature {fmt.HISTORY_TIMESTAMP!r} value {value} ({_utc(value)}) of "
                        f"event {event} is before data.options.validation.time_floor {floor} "
                        f"({_utc(floor)})")
            c.reject("time", rows_of(early), describe_early)
    # Order among the events that stay (a trimmed placeholder does not count as going back).
    kept = ~(future | early)
    kept_index = np.flatnonzero(kept)
    backwards = np.zeros(stamps.size, dtype=bool)
    if kept_index.size > 1:
        same_row = event_rows[kept_index[1:]] == event_rows[kept_index[:-1]]
        backwards[kept_index[1:]] = same_row & (stamps[kept_index[1:]]
                                                < stamps[kept_index[:-1]])
    if backwards.any():
        def describe_backwards(row: int) -> str:
            event = first_event(backwards, row)
            position = int(hist_offsets[row]) + event
            previous = kept_index[np.searchsorted(kept_index, position) - 1]
            return (f"feature {fmt.HISTORY_TIMESTAMP!r} goes back in time at event {event}: "
                    f"{int(stamps[previous])} then {int(stamps[position])} (history events "
                    "must be oldest first)")
        c.reject("time", rows_of(backwards), describe_backwards)
    if policy.time == "trim" and not kept.all():
        c.repair("time", rows_of(~kept))
        if replaced:
            table = pa.table(columns, schema=table.schema)
            replaced = False
        table = _trim_events(table, schema, kept)
        columns = {name: table.column(name) for name in table.column_names}
    return table, columns, replaced


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
