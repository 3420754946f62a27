"""The ``time`` check: a history must hold only the past of its request, oldest first.

A history event later than its request leaks the future into the history; one earlier than
``time_floor`` is a placeholder or a corrupt value (such as -2^62). Either fails the request
(``error``, ``drop``) or is cut from every history column (``trim``). A request earlier than
the floor, or a history whose kept events go back in time, cannot be trimmed into sense: an
error under ``error``, else the request is dropped.
"""

from __future__ import annotations

import datetime
from typing import Any

import numpy as np
import pyarrow as pa

from gem_core.schema import FeatureSchema
from gem_data import format as fmt
from gem_data.arrow_io import gather_jagged, list_array, list_parts, nested_list_parts, scalar_parts
from gem_data.validation_checker import Checker
from gem_data.validation_columns import rebuild


def utc_date(seconds: int) -> str:
    """``seconds`` as a UTC date for messages (``not a representable date`` when outside what a
    date can hold)."""
    try:
        return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, OSError, ValueError):
        return "not a representable date"


def check_time(table: Any, columns: dict[str, Any], replaced: bool, schema: FeatureSchema,
               c: Checker) -> tuple[Any, dict[str, Any], bool]:
    """The ``time`` check: requests before the floor; history events after their request or
    before the floor (trimmed under ``trim``); histories whose remaining events go back in
    time. Returns the (possibly trimmed) table, its columns and whether columns still differ
    from the table."""
    policy = c.policy
    n, floor = table.num_rows, policy.time_floor
    stamps, hist_offsets = list_parts(columns[fmt.HISTORY_TIMESTAMP])
    request = scalar_parts(columns[fmt.REQUEST_TIMESTAMP])
    early_requests = request < floor
    if early_requests.any():
        c.reject("time", early_requests, lambda row: (
            f"feature {fmt.REQUEST_TIMESTAMP!r} value {int(request[row])} "
            f"({utc_date(int(request[row]))}) is before data.options.validation.time_floor "
            f"{floor} ({utc_date(floor)})"))
    if not stamps.size:
        return table, columns, replaced
    events = _Events(stamps, hist_offsets, n)
    future = stamps > request[events.rows]
    early = stamps < floor
    if policy.time != "trim":
        _reject_future(c, events, future, request)
        _reject_early(c, events, early, floor)
    # Order among the events that stay (a trimmed placeholder does not count as going back).
    kept = ~(future | early)
    _reject_backwards(c, events, kept)
    if policy.time == "trim" and not kept.all():
        c.repair("time", events.rows_of(~kept))
        if replaced:
            table = pa.table(columns, schema=table.schema)
            replaced = False
        table = _trim_events(table, schema, kept)
        columns = {name: table.column(name) for name in table.column_names}
    return table, columns, replaced


class _Events:
    """A row group's history events: their times, the row of each, and the way back from a
    mask over events to the rows and the first event of a row it marks."""

    def __init__(self, stamps: np.ndarray, offsets: np.ndarray, n: int) -> None:
        self.stamps, self.offsets, self.n = stamps, offsets, n
        self.rows = np.repeat(np.arange(n), np.diff(offsets))

    def first(self, mask: np.ndarray, row: int) -> int:
        """The index within ``row``'s history of its first event in ``mask``."""
        start, end = int(self.offsets[row]), int(self.offsets[row + 1])
        return int(np.flatnonzero(mask[start:end])[0])

    def rows_of(self, mask: np.ndarray) -> np.ndarray:
        rows = np.zeros(self.n, dtype=bool)
        rows[self.rows[mask]] = True
        return rows


def _reject_future(c: Checker, events: _Events, future: np.ndarray, request: np.ndarray) -> None:
    if future.any():
        stamps, offsets = events.stamps, events.offsets

        def describe_future(row: int) -> str:
            event = events.first(future, row)
            return (f"feature {fmt.HISTORY_TIMESTAMP!r} value "
                    f"{int(stamps[offsets[row] + event])} of event {event} is after "
                    f"the request's {fmt.REQUEST_TIMESTAMP!r} {int(request[row])} (history "
                    "events must not be later than their request)")
        c.reject("time", events.rows_of(future), describe_future)


def _reject_early(c: Checker, events: _Events, early: np.ndarray, floor: int) -> None:
    if early.any():
        stamps, offsets = events.stamps, events.offsets

        def describe_early(row: int) -> str:
            event = events.first(early, row)
            value = int(stamps[offsets[row] + event])
            return (f"feature {fmt.HISTORY_TIMESTAMP!r} value {value} ({utc_date(value)}) of "
                    f"event {event} is before data.options.validation.time_floor {floor} "
                    f"({utc_date(floor)})")
        c.reject("time", events.rows_of(early), describe_early)


def _reject_backwards(c: Checker, events: _Events, kept: np.ndarray) -> None:
    """Histories whose ``kept`` events are not oldest first."""
    stamps = events.stamps
    kept_index = np.flatnonzero(kept)
    backwards = np.zeros(stamps.size, dtype=bool)
    if kept_index.size > 1:
        same_row = events.rows[kept_index[1:]] == events.rows[kept_index[:-1]]
        backwards[kept_index[1:]] = same_row & (stamps[kept_index[1:]]
                                                < stamps[kept_index[:-1]])
    if backwards.any():
        def describe_backwards(row: int) -> str:
            event = events.first(backwards, row)
            position = int(events.offsets[row]) + event
            previous = kept_index[np.searchsorted(kept_index, position) - 1]
            return (f"feature {fmt.HISTORY_TIMESTAMP!r} goes back in time at event {event}: "
                    f"{int(stamps[previous])} then {int(stamps[position])} (history events "
                    "must be oldest first)")
        c.reject("time", events.rows_of(backwards), describe_backwards)


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
            columns[name] = rebuild(table.column(name), values[value_index],
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
