"""Histories of ``gem data import``: which events precede each request, and the *history tail* a
data set of time windows keeps so that the next window continues every user's history.

A request's history is its user's events **strictly before** the request time, oldest first, the
most recent ``max_seq_len`` (:func:`history_bounds`). In a data set of windows
(:class:`~gem_data.manifest.TimeWindow`, ``gem data import --window``), each window's state file
``history_tail.parquet`` holds, per user, the most recent ``max_seq_len`` events up to the
window's end, one row per event, sorted by user, time and order in the logs: ``user_id`` (the
data set's user number), ``time`` and every event feature's ids (``event.<name>``, as in the data
set's files: vocabulary and ``hash`` ids already applied). Every event of a later window is later
than the window's ``last_time``, so a later request's history is the tail's events of its user
followed by the new window's events before it: exactly what one import of all the logs gives.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from gem_data import format as fmt

TAIL_FILE = "history_tail.parquet"
"""The state file of a window: each user's most recent events (see the module doc)."""

TIME = "time"
"""The tail's column of event times."""

Ids = tuple  # (offsets or None, int64 values), as gem_data.import_features gives them


def history_bounds(request_user: np.ndarray, request_time: np.ndarray, event_user: np.ndarray,
                   event_time: np.ndarray, max_seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Per request, ``[begin, end)`` into the events (sorted by user, time, order) that form its
    history. Requests are merged into the events with ties placed before events, so an event at
    exactly the request time counts as later; the events before request r in the merged order
    and of the same user are its history, of which the last ``max_seq_len`` are kept."""
    merged_user = np.r_[request_user, event_user]
    merged_time = np.r_[request_time, event_time]
    is_event = np.r_[np.zeros(request_user.size, dtype=np.int8),
                     np.ones(event_user.size, dtype=np.int8)]
    merged = np.lexsort((is_event, merged_time, merged_user))
    position = np.empty(merged.size, dtype=np.int64)
    position[merged] = np.arange(merged.size)
    requests_before = np.cumsum(1 - is_event[merged]) - 1  # requests up to and incl. this one
    end = position[:request_user.size] - requests_before[position[:request_user.size]]
    user_first_event = np.searchsorted(event_user, request_user, side="left")
    return np.maximum(user_first_event, end - max_seq_len), end


def tail_rows(event_user: np.ndarray, max_seq_len: int) -> np.ndarray:
    """Which of the events (sorted by user, time, order) are among their user's last
    ``max_seq_len``: the rows of the history tail."""
    user_end = np.searchsorted(event_user, event_user, side="right")
    return np.arange(event_user.size) >= user_end - max_seq_len


def concat_ids(first: Ids, second: Ids) -> Ids:
    """The ids of ``first``'s rows followed by ``second``'s."""
    (a_offsets, a_values), (b_offsets, b_values) = first, second
    values = np.concatenate([a_values, b_values]).astype(np.int64, copy=False)
    if a_offsets is None:
        return None, values
    return np.r_[a_offsets[:-1], b_offsets + a_offsets[-1]], values


def no_ids(feature: Any) -> Ids:
    """The ids of no rows of an event feature."""
    empty = np.zeros(0, dtype=np.int64)
    return (np.zeros(1, dtype=np.int64), empty) if feature.multi_valued else (None, empty)


def tail_schema(schema: Any) -> Any:
    """The arrow schema of a history tail (see the module doc)."""
    import pyarrow as pa

    ids = pa.list_(pa.int64())
    return pa.schema([pa.field(fmt.USER_ID, pa.int64(), nullable=False),
                      pa.field(TIME, pa.int64(), nullable=False)]
                     + [pa.field(fmt.event_column(f.name), ids if f.multi_valued else pa.int64(),
                                 nullable=False) for f in schema.event_features])


def tail_table(schema: Any, users: np.ndarray, times: np.ndarray, ids: dict[str, Ids]) -> Any:
    """A history tail from its rows' user numbers, times and event ids (in the tail's order)."""
    import pyarrow as pa

    columns = [pa.array(users, pa.int64()), pa.array(times, pa.int64())]
    for f in schema.event_features:
        offsets, values = ids[f.name]
        columns.append(pa.array(values, pa.int64()) if offsets is None else
                       pa.ListArray.from_arrays(pa.array(offsets, pa.int32()),
                                                pa.array(values, pa.int64())))
    return pa.Table.from_arrays(columns, schema=tail_schema(schema))


def read_tail(path: Path, schema: Any) -> tuple[np.ndarray, np.ndarray, dict[str, Ids]]:
    """A history tail's user numbers, times and event ids (see :func:`tail_table`)."""
    import pyarrow.parquet as pq

    from gem_core.errors import GemDataError

    table = pq.read_table(path)
    if not table.schema.equals(tail_schema(schema)):
        raise GemDataError(f"{path}: the history tail does not have the columns of the data "
                           f"set's event features:\n{table.schema}\nexpected\n"
                           f"{tail_schema(schema)}")
    ids = {}
    for f in schema.event_features:
        column = table.column(fmt.event_column(f.name)).combine_chunks()
        if f.multi_valued:  # offsets from 0 and the values they span (a slice has others)
            offsets = column.offsets.to_numpy().astype(np.int64)
            ids[f.name] = (offsets - offsets[0], column.flatten().to_numpy().astype(np.int64))
        else:
            ids[f.name] = (None, column.to_numpy().astype(np.int64))
    return (table.column(fmt.USER_ID).to_numpy().astype(np.int64),
            table.column(TIME).to_numpy().astype(np.int64), ids)
