"""``gem data import``: a flat impression log plus an event log -> a request-level data set.

Inputs (Parquet or CSV, by file suffix ``.parquet``/``.pq`` or ``.csv``):

- an **impression log**: one row per impression (candidate shown), with the user, the request
  time, one column per candidate feature, one per task label (0/1), optionally a request id
  (impressions of one request share it; without one a request is one user at one time:
  :mod:`gem_data.import_requests`) and context (``sparse``) and dense columns;
- an **event log**: one row per history event, with the user, the event time and one column per
  event feature;
- optionally **side tables** (``[[import.join]]``): ad or user attributes joined into either log
  by key, their columns becoming features (:mod:`gem_data.import_features`).

and a **schema file** (TOML): the :class:`~gem_core.schema.FeatureSchema` fields
(:func:`gem_core.schema.schema_from_dict`) plus an optional ``[import]`` table naming columns
and saying how missing values and string categories are treated
(:class:`~gem_data.import_options.ImportOptions`). By default a feature's column is its name
(``ad_id``), a task's label column is the task name (``click``), a context feature's column is
its name.

Each request's history is the user's events **strictly before** the request time (an event at
exactly the request time is left out: it may be the logged outcome of the impression itself),
oldest first, at most ``max_seq_len`` (the most recent). The latest ``eval_fraction`` of the
requests by time form the eval split (:func:`split_time`: requests of one time stay on one
side); a request's context (``sparse`` and dense columns) must be the same on all its
impressions.

Multi-valued features are list columns in Parquet, or strings of ids joined by ``delimiter`` in
CSV. Ids are exact 64-bit integers from either format (uint64 kept with the same bits; never
through float64: :mod:`gem_data.import_log`), or text mapped to ids by ``[import.strings]``
(:mod:`gem_data.import_strings`). Timestamps are integers (any unit, the same in both logs, none
before ``time_floor``) or Arrow timestamps (whole seconds, rounded down).

The data set is written into a staging directory beside ``out`` and renamed into place when
complete, so a failed import leaves no files. ``--window NAME`` writes the logs as one time
window of a data set of windows, ``--append`` adds one to it (:mod:`gem_data.import_append`).

Engines (``--engine``): ``numpy``, here, the reference: pyarrow reads and sorts; numpy does the
grouping and the history cut with sorts and searches (no Python loop per row or per request),
the whole log held in memory. ``duckdb`` (:mod:`gem_data.import_duckdb`), for logs larger than
memory: the logs read in blocks and converted by this path's code
(:mod:`gem_data.import_stage`), then the join, grouping and split in DuckDB, out of core. Both
write the same data set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import numpy as np

from gem_data.import_features import Features, describe_counts, read_labels
from gem_data.import_log import Log
from gem_data.import_options import (
    ImportOptions,
    text_columns,
)
from gem_data.import_requests import mixed_dense, mixed_request, read_keys, same_bags

# -- building -------------------------------------------------------------------------------


def _take(ids: tuple[np.ndarray | None, np.ndarray], rows: np.ndarray) -> Any:
    """The feature's ids of ``rows`` (in that order): a tensor, or a Jagged for multi-valued."""
    import torch

    from gem_core.jagged import Jagged

    offsets, values = ids
    if offsets is None:
        return torch.from_numpy(np.ascontiguousarray(values[rows]))
    lengths = np.diff(offsets)[rows]
    new = np.zeros(rows.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=new[1:])
    index = np.arange(int(new[-1])) + np.repeat(offsets[:-1][rows] - new[:-1], lengths)
    return Jagged(torch.from_numpy(values[index]), torch.from_numpy(new))


def build_requests(impressions: str | Path, events: str | Path, schema: Any,
                   options: ImportOptions, *, vocabularies: dict[str, Any] | None = None
                   ) -> dict[str, Any]:
    """Per split (``train``, ``eval``), the requests of the logs as one JaggedBatch, in request
    time order. Raises GemDataError naming file, row and column of the first bad value."""
    return _build(impressions, events, schema, options, vocabularies)[0]


def _build(impressions: str | Path, events: str | Path, schema: Any, options: ImportOptions,
           vocabularies: dict[str, Any] | None = None, *, windowed: bool = False,
           earlier: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """:func:`build_requests` and the import's report: the train/eval cut
    (:func:`gem_data.import_split.split_time`), per feature the missing-value counts, the
    request key, the vocabularies built. ``windowed``: the logs are one time window
    (:mod:`gem_data.import_append`): the report also holds the window's ``history_tail`` (a
    table, :mod:`gem_data.import_history`) and ``last_time``. ``earlier``: the
    :class:`~gem_data.import_append.Earlier` windows it follows, whose tail starts the
    histories.

    The steps keep this order (the logs' values, the requests' keys and ids, the context),
    which decides the error raised when a log has several faults; the DuckDB engine
    (:mod:`gem_data.import_duckdb`) checks in the same order."""
    from gem_data.import_history import tail_rows, tail_table
    from gem_data.import_split import split_time

    o = options
    logs = _read_logs(impressions, events, schema, o, vocabularies, earlier)
    requests = _group_requests(logs, o)
    history = _sort_histories(logs, requests, schema)
    columns = _request_columns(logs, requests, schema, o)

    # Splits by request time: eval from the cut on (none without a cut).
    cut, summary = split_time(requests.time, o.eval_fraction)
    by_time = requests.by_time
    in_eval = np.zeros(by_time.size, dtype=bool) if cut is None else \
        requests.time[by_time] >= cut
    result = {}
    for split, mask in (("train", ~in_eval), ("eval", in_eval)):
        req = by_time[mask]
        if req.size:
            result[split] = _batch(req, logs, requests, history, columns, schema)
    imp, ev, keys = logs.imp, logs.ev, logs.keys
    all_requests = int(np.unique(keys.code).size)
    report = {
        "split": summary,
        "requests": {"key": list(keys.columns), "requests": int(requests.head.size),
                     "dropped_impressions": int(imp.table.num_rows - requests.live.size),
                     "dropped_events": int(ev.table.num_rows - history.live.size
                                           + logs.tail_size),
                     "dropped_requests": all_requests - int(requests.head.size),
                     "user_ids": "integers" if logs.imp_user.dtype.kind in "iu" else "text"},
        "features": logs.features.counts,
        "vocabularies": logs.features.vocabularies,
    }
    if windowed:  # each user's last max_seq_len events, for the next window
        rows = history.order[tail_rows(history.user, schema.max_seq_len)]
        report["history_tail"] = tail_table(
            schema, logs.users[logs.ev_code[rows]], logs.ev_time[rows],
            {name: _ids_of(ids, rows) for name, ids in history.ids.items()})
        report["last_time"] = logs.last_time
    return result, report


@attrs.frozen(kw_only=True)
class _Logs:
    """Both logs read and converted (every value checked, with its file and row in errors),
    and every user numbered once over both logs and the earlier windows' tail."""

    imp: Log
    ev: Log
    has_events: bool
    features: Features
    keys: Any
    """The impressions' request keys (:func:`~gem_data.import_requests.read_keys`)."""
    users: np.ndarray
    """The users' stable numbers (the data set's ``user_id``), sorted: a user code indexes it."""
    imp_user: np.ndarray
    """Per impression, its user id as read."""
    imp_code: np.ndarray
    imp_time: np.ndarray
    ev_code: np.ndarray
    """Per event, its user code: the earlier windows' tail first, then the event log's rows."""
    ev_time: np.ndarray
    """Per event, its time, in the order of ``ev_code``."""
    tail_ids: dict[str, Any]
    tail_size: int
    """How many events of the earlier windows' tail come before the event log's."""
    last_time: int
    """The latest time of the logs: every request and event, also those dropped."""


def _read_logs(impressions: str | Path, events: str | Path, schema: Any, o: ImportOptions,
               vocabularies: dict[str, Any] | None, earlier: Any) -> _Logs:
    from gem_core.errors import GemDataError
    from gem_data.import_history import no_ids
    from gem_data.import_requests import user_numbers
    from gem_data.import_users import user_keys

    imp = Log(Path(impressions), "impression log", o.delimiter,
              text_columns(schema, o, "impressions"))
    ev = Log(Path(events), "event log", o.delimiter, text_columns(schema, o, "events"))
    if imp.table.num_rows == 0:
        raise GemDataError(f"{imp.path}: the impression log has no rows")
    has_events = ev.table.num_rows > 0
    features = Features(schema, o, imp, ev if has_events else None, vocabularies)

    # Keys: users shared by both logs (and the earlier windows' tail), requests within the
    # impression log. Users are numbered by their stable number, the data set's user_id.
    as_text = None if earlier is None else earlier.user_text
    imp_user = user_keys(imp, o.user_column, as_text)
    ev_user = user_keys(ev, o.user_column, as_text) if has_events else imp_user[:0]
    if has_events and imp_user.dtype.kind != ev_user.dtype.kind:
        raise GemDataError(f"column {o.user_column!r}: the user ids of {imp.path} and {ev.path} "
                           "have different types (one integers, one text)")
    tail_user, tail_time, tail_ids = earlier.events(schema) if earlier is not None else (
        np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64),
        {f.name: no_ids(f) for f in schema.event_features})
    numbers = user_numbers(np.concatenate([imp_user, ev_user]),
                           where=f"column {o.user_column!r} of {imp.path} and {ev.path}: ")
    users, user_code = np.unique(np.r_[numbers, tail_user], return_inverse=True)
    imp_code, ev_code = user_code[:imp_user.size], user_code[imp_user.size:numbers.size]
    keys = read_keys(imp, o)
    imp_time = imp.times(o.timestamp_column, "request time")
    imp.check_floor(imp_time, o.timestamp_column, "request time", o.time_floor)
    ev_time = ev.times(o.timestamp_column, "event time") if has_events \
        else np.zeros(0, dtype=np.int64)
    ev.check_floor(ev_time, o.timestamp_column, "event time", o.time_floor)
    if earlier is not None:
        earlier.refuse_not_later(imp, imp_time, o.timestamp_column, "request time")
        earlier.refuse_not_later(ev, ev_time, o.timestamp_column, "event time")
    return _Logs(imp=imp, ev=ev, has_events=has_events, features=features, keys=keys,
                 users=users, imp_user=imp_user, imp_code=imp_code, imp_time=imp_time,
                 ev_code=np.r_[user_code[numbers.size:], ev_code],
                 ev_time=np.r_[tail_time, ev_time], tail_ids=tail_ids, tail_size=tail_user.size,
                 last_time=int(max(imp_time.max(), ev_time.max(initial=imp_time.max()))))


@attrs.frozen(kw_only=True)
class _Requests:
    """The impressions kept, grouped into requests by key."""

    live: np.ndarray
    """The impressions kept (``missing = "drop"`` leaves some out), rows in the file."""
    order: np.ndarray
    """The impressions kept, request by request, each request's in file order."""
    starts: np.ndarray
    """Per request, where its impressions start in ``order``."""
    group_of: np.ndarray
    """Per impression in ``order``, its request."""
    head: np.ndarray
    """Per request, its first impression (row in the file): its time, user and context."""
    time: np.ndarray
    user: np.ndarray
    """Per request, its user code."""
    by_time: np.ndarray
    """The requests ordered by time, then first row."""
    counts: np.ndarray
    """Per request, its number of impressions (candidates)."""


def _group_requests(logs: _Logs, o: ImportOptions) -> _Requests:
    """Group the impressions kept by request key; a request's user and time (when not in its
    key) must be the same on all its impressions, and its 64-bit id its own."""
    from gem_core.errors import GemDataError

    imp, keys = logs.imp, logs.keys
    live = np.flatnonzero(logs.features.keep["impressions"])
    if live.size == 0:
        raise GemDataError(f"{imp.path}: every impression was dropped for a missing value "
                           f"(missing = \"drop\"): "
                           f"{'; '.join(describe_counts(logs.features.counts))}")
    _, live_code = np.unique(keys.code[live], return_inverse=True)
    live_code = live_code.reshape(-1)
    order = live[np.lexsort((live, live_code))]
    request_code = np.full(imp.table.num_rows, -1, dtype=np.int64)
    request_code[live] = live_code
    first = np.r_[True, request_code[order][1:] != request_code[order][:-1]]
    starts = np.flatnonzero(first)
    group_of = np.cumsum(first) - 1  # per sorted impression, its request
    for name, values, raw, role in ((o.user_column, logs.imp_code, logs.imp_user, "user"),
                                    (o.timestamp_column, logs.imp_time, logs.imp_time,
                                     "request time")):
        if name in keys.columns:
            continue
        differs = np.flatnonzero(values[order] != values[order][starts][group_of])
        if differs.size:
            row = int(order[differs[0]])
            other = int(order[starts][group_of][differs[0]])
            imp.fail(row, name, mixed_request(keys.name(row), role, raw[other].item(),
                                              raw[row].item()))
    head = order[starts]  # the first impression of each request (file order)
    keys.ids(head)  # the requests' 64-bit ids: checked one to one with their keys
    request_time = logs.imp_time[head]
    return _Requests(live=live, order=order, starts=starts, group_of=group_of, head=head,
                     time=request_time, user=logs.imp_code[head],
                     by_time=np.lexsort((head, request_time)),  # by time, then first row
                     counts=np.diff(np.r_[starts, order.size]))


@attrs.frozen(kw_only=True)
class _Histories:
    """The events kept, sorted by (user, time, row), and each request's slice of them."""

    ids: dict[str, Any]
    """Per event feature, the ids of every event (the tail's first)."""
    live: np.ndarray
    """The events kept (every event of the tail), indices into ``ids``."""
    order: np.ndarray
    """``live`` sorted by (user, time, row)."""
    user: np.ndarray
    """The user code of each event in ``order``."""
    begin: np.ndarray
    end: np.ndarray
    """Per request, its history: ``order[begin:end]``."""


def _sort_histories(logs: _Logs, requests: _Requests, schema: Any) -> _Histories:
    """History: the user's events strictly before the request time (import_history). The
    earlier windows' tail comes first (its rows before the log's): every event of it is older
    than the log's, and its own order is kept."""
    from gem_data.import_history import concat_ids, history_bounds, no_ids

    features = logs.features
    event_ids = {f.name: concat_ids(logs.tail_ids[f.name], features.ids[f"event.{f.name}"]
                                    if logs.has_events else no_ids(f))
                 for f in schema.event_features}
    ev_live = np.r_[np.arange(logs.tail_size),
                    logs.tail_size + np.flatnonzero(features.keep["events"])]
    ev_order = ev_live[np.lexsort((ev_live, logs.ev_time[ev_live], logs.ev_code[ev_live]))]
    e_user = logs.ev_code[ev_order]
    begin, end = history_bounds(requests.user, requests.time, e_user, logs.ev_time[ev_order],
                                schema.max_seq_len)
    return _Histories(ids=event_ids, live=ev_live, order=ev_order, user=e_user, begin=begin,
                      end=end)


@attrs.frozen(kw_only=True)
class _RequestColumns:
    """The impressions' candidate ids, labels, context bags, dense values and candidate numeric
    values."""

    candidate_ids: dict[str, Any]
    labels: dict[str, np.ndarray]
    sparse: dict[str, Any]
    dense: np.ndarray | None
    candidate_numeric: np.ndarray | None = None


def _request_columns(logs: _Logs, requests: _Requests, schema: Any,
                     o: ImportOptions) -> _RequestColumns:
    """The features, checked over whole columns (errors name the input row); the context
    describes the request, so every impression of one must agree with its first."""
    imp, features, keys = logs.imp, logs.features, logs.keys
    cand_ids = {f.name: features.ids[f"candidate.{f.name}"] for f in schema.candidate_features}
    labels = read_labels(imp, schema, o)
    sparse = {f.name: features.ids[f"sparse.{f.name}"] for f in schema.sparse_features}
    dense = features.dense
    order = requests.order
    heads_of = order[requests.starts][requests.group_of]  # per impression, its request's first
    for f in schema.sparse_features:
        same_bags(imp, features.column("sparse", f.name), f"context feature {f.name!r}",
                  sparse[f.name], order, heads_of, keys)
    for index, name in enumerate(o.dense_columns):
        differs = np.flatnonzero(dense[order, index] != dense[heads_of, index])
        if differs.size:
            row, other = int(order[differs[0]]), int(heads_of[differs[0]])
            imp.fail(row, name, mixed_dense(keys.name(row), name, dense[other, index],
                                            imp.row_name(other), dense[row, index]))
    return _RequestColumns(candidate_ids=cand_ids, labels=labels, sparse=sparse, dense=dense,
                           candidate_numeric=features.candidate_numeric)


def _batch(req: np.ndarray, logs: _Logs, requests: _Requests, history: _Histories,
           columns: _RequestColumns, schema: Any) -> Any:
    """The requests ``req`` (indices, in the order wanted) as one JaggedBatch."""
    import torch

    from gem_core.batch import JaggedBatch

    t = torch.from_numpy
    lengths = history.end[req] - history.begin[req]
    seq_offsets = np.zeros(req.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=seq_offsets[1:])
    ev_rows_sorted = np.arange(int(seq_offsets[-1])) + np.repeat(
        history.begin[req] - seq_offsets[:-1], lengths)
    ev_rows = history.order[ev_rows_sorted]  # input rows of the history events
    counts = requests.counts[req]
    c_offsets = np.zeros(req.size + 1, dtype=np.int64)
    np.cumsum(counts, out=c_offsets[1:])
    imp_rows = requests.order[np.arange(int(c_offsets[-1])) + np.repeat(
        requests.starts[req] - c_offsets[:-1], counts)]
    heads = requests.head[req]
    bag = {}
    for name, (offsets, values) in columns.sparse.items():
        bag[name] = _take((offsets, values), heads)
    dense, numeric = columns.dense, columns.candidate_numeric
    return JaggedBatch(
        seq_offsets=t(seq_offsets),
        seq_timestamps=t(np.ascontiguousarray(logs.ev_time[ev_rows])),
        event_ids={f.name: _take(history.ids[f.name], ev_rows)
                   for f in schema.event_features},
        request_timestamps=t(np.ascontiguousarray(requests.time[req])),
        candidate_offsets=t(c_offsets),
        candidate_ids={name: _take(ids, imp_rows) for name, ids in columns.candidate_ids.items()},
        labels={task: t(np.ascontiguousarray(v[imp_rows])) for task, v in columns.labels.items()},
        sparse=bag,
        dense=None if dense is None else t(dense[heads].astype(np.float32)),
        candidate_numeric=None if numeric is None else t(numeric[imp_rows].astype(np.float32)),
        user_ids=t(logs.users[requests.user[req]]),
    )


def _ids_of(ids: tuple[np.ndarray | None, np.ndarray], rows: np.ndarray) -> tuple:
    """``(offsets, values)`` of the feature's ``rows`` (in that order), as numpy arrays."""
    taken = _take(ids, rows)
    if ids[0] is None:
        return None, taken.numpy()
    return taken.offsets.numpy(), taken.values.numpy()


def import_info(sources: dict[str, Any], options: ImportOptions, report: dict[str, Any],
                directory: Path, engine_info: dict[str, Any]) -> dict[str, Any]:
    """The manifest's ``info`` of an import (see :func:`import_logs`); writes the vocabularies
    built into ``directory``."""
    return {"source": "gem data import", **{key: str(value) for key, value in sources.items()},
            "import": attrs.asdict(options), "split": report["split"],
            "requests": report["requests"], "features": report["features"],
            "vocabularies": {table: vocabulary.write(directory) for table, vocabulary
                             in sorted(report["vocabularies"].items())},
            "engine": engine_info}


def describe_import(info: dict[str, Any]) -> list[str]:
    """The lines the import prints after its summary: how requests were keyed, what was
    dropped, per feature its missing values, the vocabularies."""
    requests = info.get("requests", {})
    key = requests.get("key", [])
    lines = [f"requests keyed by {' + '.join(key)}" if key else ""]
    dropped = [f"{requests[k]} {k.split('_')[1]}" for k in
               ("dropped_impressions", "dropped_events", "dropped_requests") if requests.get(k)]
    if dropped:
        lines.append(f"dropped for missing values: {', '.join(dropped)}")
    lines += describe_counts(info.get("features", {}))
    for table, entry in info.get("vocabularies", {}).items():
        source = f" (from {entry['from']})" if entry.get("from") else ""
        lines.append(f"vocabulary of table {table}: {entry['values']} values{source} in "
                     f"{entry['path']}")
    return [line for line in lines if line]
