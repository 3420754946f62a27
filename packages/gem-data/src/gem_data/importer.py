"""``gem data import``: a flat impression log plus an event log -> a request-level data set.

Inputs (Parquet or CSV, by file suffix ``.parquet``/``.pq`` or ``.csv``):

- an **impression log**: one row per impression (candidate shown), with the user, a request id
  (impressions of one request share it), the request time, one column per candidate feature,
  one per task label (0/1), and optionally context (``sparse``) and dense columns;
- an **event log**: one row per history event, with the user, the event time and one column per
  event feature.

and a **schema file** (TOML): the :class:`~gem_core.schema.FeatureSchema` fields
(:func:`gem_core.schema.schema_from_dict`) plus an optional ``[import]`` table naming columns
(:class:`ImportOptions`). By default a feature's column is its name (``ad_id``), a task's label
column is the task name (``click``), a context feature's column is its name.

Each request's history is the user's events **strictly before** the request time (an event at
exactly the request time is left out: it may be the logged outcome of the impression itself),
oldest first, at most ``max_seq_len`` (the most recent). The latest ``eval_fraction`` of the
requests by time form the eval split (:func:`split_time`: requests of one time stay on one
side); a request's context (``sparse`` and dense columns) must be the same on all its
impressions.

Multi-valued features are list columns in Parquet, or strings of ids joined by ``delimiter`` in
CSV. Ids are exact 64-bit integers from either format (uint64 kept with the same bits; never
through float64: :mod:`gem_data.import_log`). Timestamps are integers (any unit, the same in
both logs, none before ``time_floor``) or Arrow timestamps (whole seconds, rounded down).

The data set is written into a staging directory beside ``out`` and renamed into place when
complete, so a failed import leaves no files.

Implementation: pyarrow reads and sorts; numpy does the grouping and the history cut with
sorts and searches (no Python loop per row or per request). The whole log is held in memory:
for logs larger than memory, import disjoint sets of users into separate data sets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import click
import numpy as np

from gem_core.config.validators import between
from gem_data.import_log import Log


@attrs.frozen(kw_only=True)
class ImportOptions:
    """The ``[import]`` table of a schema file: which columns hold what."""

    user_column: str = "user_id"
    """Column of the user id, in both logs (integers or strings)."""

    request_column: str = "request_id"
    """Impression log column grouping impressions into requests (integers or strings)."""

    timestamp_column: str = "timestamp"
    """Column of the time, in both logs: the request time (impressions of one request share
    it) and the event time."""

    columns: dict[str, str] = attrs.field(factory=dict)
    """Column of a feature whose column is not its name: keys ``event.<name>``,
    ``candidate.<name>``, ``label.<task>`` or ``sparse.<name>``, values column names."""

    dense_columns: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    """Impression log columns of the ``num_dense`` dense request features, in order (the same
    on every impression of a request)."""

    delimiter: str = "|"
    """Separator of the ids of a multi-valued feature in a CSV cell (``"3|17|4"``)."""

    eval_fraction: float = attrs.field(default=0.1, validator=between(0.0, 0.9))
    """Latest share of requests (by request time) written as the eval split; 0: none (the
    ``parquet`` source then holds out trailing row groups). Requests of one time stay on one
    side, so the share written can differ (by less than half of the tied requests at the cut);
    the import reports it."""

    time_floor: int = attrs.field(default=0, validator=attrs.validators.instance_of(int))
    """Earliest plausible time: a request or event before it stops the import, naming the row.
    The default, 0, is 1970-01-01 in seconds (a negative time is a placeholder or corrupt)."""


def read_schema_file(path: str | Path) -> tuple[Any, ImportOptions]:
    """The :class:`FeatureSchema` and :class:`ImportOptions` of a schema TOML file."""
    import tomllib

    from gem_core.config import structure
    from gem_core.errors import GemConfigError, GemDataError
    from gem_core.schema import schema_from_dict

    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise GemDataError(f"{path}: cannot read the schema file ({error})") from None
    section = data.pop("import", {})
    try:
        schema = schema_from_dict(data, where=str(path))  # its errors name the path
        options = structure(ImportOptions, section, "import")
    except (ValueError, GemConfigError) as error:
        message = str(error)
        raise GemDataError(message if message.startswith(str(path)) else f"{path}: {message}"
                           ) from None
    if schema.seq_dense_dim or schema.candidate_content or schema.user_embedding_dim:
        raise GemDataError(f"{path}: gem data import does not read content vectors or user "
                           "embeddings yet (seq_dense_dim, candidate_content, "
                           "user_embedding_dim must be 0)")
    _check_column_keys(path, schema, options)
    if len(options.dense_columns) != schema.num_dense:
        raise GemDataError(f"{path}: num_dense = {schema.num_dense} but import.dense_columns "
                           f"names {len(options.dense_columns)} columns")
    return schema, options


def _check_column_keys(path: Path, schema: Any, options: ImportOptions) -> None:
    """Refuse an ``[import.columns]`` key that names no feature or task of the schema (a typo
    would otherwise leave the feature reading the column of its own name), with close
    matches."""
    import difflib

    from gem_core.errors import GemDataError

    known = ([f"event.{f.name}" for f in schema.event_features]
             + [f"candidate.{f.name}" for f in schema.candidate_features]
             + [f"label.{task}" for task in schema.tasks]
             + [f"sparse.{f.name}" for f in schema.sparse_features])
    for key in options.columns:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
            hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
            raise GemDataError(f"{path}: unknown key {key!r} in [import.columns]{hint}; keys are "
                               "event.<feature>, candidate.<feature>, label.<task> or "
                               f"sparse.<feature> of the schema: {', '.join(known)}")


def _check_dense_ids(log: Log, column: str, values: np.ndarray, owner: np.ndarray | None,
                     table: Any) -> None:
    """Under the ``dense`` id policy, every id must be a row of the table: name the first
    that is not, by input row."""
    if table.id_policy != "dense" or values.size == 0:
        return
    bad = np.flatnonzero((values < 0) | (values >= table.num_embeddings))
    if bad.size:
        row = int(bad[0] if owner is None else owner[bad[0]])
        log.fail(row, column, f"id {int(values[bad[0]])} is outside [0, {table.num_embeddings}) "
                              f"of table {table.name!r} (id_policy dense; {bad.size} such ids); "
                              "use id_policy = \"modulo\" or \"hash\" for unbounded ids")


# -- building -------------------------------------------------------------------------------


def _feature_ids(log: Log, feature: Any, column: str, role: str, schema: Any
                 ) -> tuple[np.ndarray | None, np.ndarray]:
    """(offsets or None, values) of a feature over the log's rows, checked."""
    table = schema.table(feature.table)
    if feature.multi_valued:
        offsets, values = log.multi_ids(column, role)
        owner = np.repeat(np.arange(offsets.size - 1), np.diff(offsets))
        _check_dense_ids(log, column, values, owner, table)
        return offsets, values
    values = log.ids(column, role)
    _check_dense_ids(log, column, values, None, table)
    return None, values


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
                   options: ImportOptions) -> dict[str, Any]:
    """Per split (``train``, ``eval``), the requests of the logs as one JaggedBatch, in request
    time order. Raises GemDataError naming file, row and column of the first bad value."""
    return _build(impressions, events, schema, options)[0]


def _build(impressions: str | Path, events: str | Path, schema: Any, options: ImportOptions
           ) -> tuple[dict[str, Any], dict[str, Any]]:
    """:func:`build_requests` and the summary of the train/eval cut
    (:func:`gem_data.import_split.split_time`)."""
    import torch

    from gem_core.batch import JaggedBatch
    from gem_core.errors import GemDataError
    from gem_data.import_split import split_time

    o = options

    def col(kind: str, name: str) -> str:
        return o.columns.get(f"{kind}.{name}", name)

    # In a CSV, ids and keys are read as text and parsed exactly (never through float64).
    keys = [o.user_column, o.request_column]
    imp = Log(Path(impressions), "impression log", o.delimiter, keys + [
        col(kind, f.name) for kind, features in (("candidate", schema.candidate_features),
                                                 ("sparse", schema.sparse_features))
        for f in features])
    ev = Log(Path(events), "event log", o.delimiter,
             keys + [col("event", f.name) for f in schema.event_features])
    if imp.table.num_rows == 0:
        raise GemDataError(f"{imp.path}: the impression log has no rows")

    # Keys: users shared by both logs, requests within the impression log.
    imp_user = imp.keys(o.user_column, "user")
    ev_user = ev.keys(o.user_column, "user") if ev.table.num_rows else imp_user[:0]
    if ev.table.num_rows and imp_user.dtype.kind != ev_user.dtype.kind:
        raise GemDataError(f"column {o.user_column!r}: the user ids of {imp.path} and {ev.path} "
                           "have different types (one integers, one text)")
    users, user_code = np.unique(np.concatenate([imp_user, ev_user]), return_inverse=True)
    imp_code, ev_code = user_code[:imp_user.size], user_code[imp_user.size:]
    request_key = imp.keys(o.request_column, "request id")
    imp_time = imp.times(o.timestamp_column, "request time")
    imp.check_floor(imp_time, o.timestamp_column, "request time", o.time_floor)
    ev_time = ev.times(o.timestamp_column, "event time") if ev.table.num_rows \
        else np.zeros(0, dtype=np.int64)
    ev.check_floor(ev_time, o.timestamp_column, "event time", o.time_floor)

    # Group impressions: by (request time, request id), impressions in file order.
    _, request_code = np.unique(request_key, return_inverse=True)
    order = np.lexsort((np.arange(request_code.size), request_code))
    first = np.r_[True, request_code[order][1:] != request_code[order][:-1]]
    starts = np.flatnonzero(first)
    group_of = np.cumsum(first) - 1  # per sorted impression, its request
    for name, values, raw, role in ((o.user_column, imp_code, imp_user, "user"),
                                    (o.timestamp_column, imp_time, imp_time, "request time")):
        differs = np.flatnonzero(values[order] != values[order][starts][group_of])
        if differs.size:
            row = int(order[differs[0]])
            other = int(order[starts][group_of][differs[0]])
            imp.fail(row, name, f"request {request_key[row].item()!r} has impressions with "
                                f"different {role}s ({raw[other].item()!r} and "
                                f"{raw[row].item()!r}); one request is one user at one time")
    head = order[starts]  # the first impression of each request (file order)
    request_time, request_user = imp_time[head], imp_code[head]
    by_time = np.lexsort((head, request_time))  # requests ordered by time, then first row
    counts = np.diff(np.r_[starts, order.size])

    # History: the user's events strictly before the request time. Sort events by (user,
    # time, file row); merge requests in with ties placed before events, so an event at
    # exactly the request time counts as later. Events before request r in the merged order
    # and of the same user are its history.
    ev_order = np.lexsort((np.arange(ev_code.size), ev_time, ev_code))
    e_user, e_time = ev_code[ev_order], ev_time[ev_order]
    merged_user = np.r_[request_user, e_user]
    merged_time = np.r_[request_time, e_time]
    is_event = np.r_[np.zeros(head.size, dtype=np.int8), np.ones(e_user.size, dtype=np.int8)]
    merged = np.lexsort((is_event, merged_time, merged_user))
    position = np.empty(merged.size, dtype=np.int64)
    position[merged] = np.arange(merged.size)
    requests_before = np.cumsum(1 - is_event[merged]) - 1  # requests up to and incl. this one
    end = position[:head.size] - requests_before[position[:head.size]]
    user_first_event = np.searchsorted(e_user, request_user, side="left")
    begin = np.maximum(user_first_event, end - schema.max_seq_len)

    # Features, checked over whole columns (errors name the input row).
    event_ids = {f.name: _feature_ids(ev, f, col("event", f.name), f"event feature {f.name!r}",
                                      schema) for f in schema.event_features} \
        if ev.table.num_rows else {}
    cand_ids = {f.name: _feature_ids(imp, f, col("candidate", f.name),
                                     f"candidate feature {f.name!r}", schema)
                for f in schema.candidate_features}
    labels = {}
    for task in schema.tasks:
        name = col("label", task)
        values = imp.floats(name, f"label of task {task!r}")
        bad = np.flatnonzero((values != 0) & (values != 1))
        if bad.size:
            imp.fail(int(bad[0]), name, f"label {values[bad[0]]} of task {task!r} is not 0 or 1")
        labels[task] = values.astype(np.float32)
    sparse = {}
    for f in schema.sparse_features:
        name = col("sparse", f.name)
        offsets, values = imp.multi_ids(name, f"context feature {f.name!r}")
        _check_dense_ids(imp, name, values,
                         np.repeat(np.arange(offsets.size - 1), np.diff(offsets)),
                         schema.table(f.table))
        sparse[f.name] = (offsets, values)
    dense = (np.stack([imp.floats(c, "dense feature") for c in o.dense_columns], axis=1)
             if o.dense_columns else None)

    # Context describes the request: every impression of one must agree with its first.
    heads_of = order[starts][group_of]  # per impression (in `order`), its request's first
    for f in schema.sparse_features:
        _same_bags(imp, col("sparse", f.name), f"context feature {f.name!r}", sparse[f.name],
                   order, heads_of, request_key)
    for index, name in enumerate(o.dense_columns):
        differs = np.flatnonzero(dense[order, index] != dense[heads_of, index])
        if differs.size:
            row, other = int(order[differs[0]]), int(heads_of[differs[0]])
            imp.fail(row, name, f"request {request_key[row].item()!r} has impressions with "
                                f"different values of dense feature {name!r} "
                                f"({dense[other, index]:g} on {imp.row_name(other)}, "
                                f"{dense[row, index]:g} here); a request's context is the "
                                "same on all its impressions")

    # Splits by request time: eval from the cut on (none without a cut).
    cut, summary = split_time(request_time, o.eval_fraction)
    in_eval = np.zeros(by_time.size, dtype=bool) if cut is None else request_time[by_time] >= cut
    t = torch.from_numpy
    result = {}
    for split, mask in (("train", ~in_eval), ("eval", in_eval)):
        req = by_time[mask]
        if req.size == 0:
            continue
        lengths = end[req] - begin[req]
        seq_offsets = np.zeros(req.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=seq_offsets[1:])
        ev_rows_sorted = np.arange(int(seq_offsets[-1])) + np.repeat(
            begin[req] - seq_offsets[:-1], lengths)
        ev_rows = ev_order[ev_rows_sorted]  # input rows of the history events
        c_offsets = np.zeros(req.size + 1, dtype=np.int64)
        np.cumsum(counts[req], out=c_offsets[1:])
        imp_rows = order[np.arange(int(c_offsets[-1])) + np.repeat(
            starts[req] - c_offsets[:-1], counts[req])]
        heads = head[req]
        bag = {}
        for name, (offsets, values) in sparse.items():
            bag[name] = _take((offsets, values), heads)
        result[split] = JaggedBatch(
            seq_offsets=t(seq_offsets),
            seq_timestamps=t(np.ascontiguousarray(ev_time[ev_rows])),
            event_ids={f.name: (_take(event_ids[f.name], ev_rows) if f.name in event_ids
                                else _empty_ids(f))
                       for f in schema.event_features},
            request_timestamps=t(np.ascontiguousarray(request_time[req])),
            candidate_offsets=t(c_offsets),
            candidate_ids={name: _take(ids, imp_rows) for name, ids in cand_ids.items()},
            labels={task: t(np.ascontiguousarray(v[imp_rows])) for task, v in labels.items()},
            sparse=bag,
            dense=None if dense is None else t(dense[heads].astype(np.float32)),
            user_ids=t(_user_numbers(users)[request_user[req]]),
        )
    return result, summary


def _same_bags(log: Log, name: str, role: str, bags: tuple[np.ndarray, np.ndarray],
               rows: np.ndarray, heads: np.ndarray, request_key: np.ndarray) -> None:
    """Refuse a context feature whose bag of ids (compared as a set with counts) on impression
    ``rows[i]`` is not the one on its request's first impression ``heads[i]``."""
    offsets, values = bags
    lengths = np.diff(offsets)
    differs = lengths[rows] != lengths[heads]
    if not differs.any():
        owner = np.repeat(np.arange(lengths.size), lengths)
        ordered = values[np.lexsort((values, owner))]  # each bag's ids sorted: order is free

        def gather(which: np.ndarray) -> np.ndarray:
            starts = np.repeat(offsets[:-1][which], lengths[which])
            within = np.arange(starts.size) - np.repeat(np.cumsum(lengths[which]) -
                                                        lengths[which], lengths[which])
            return ordered[starts + within]

        unequal = gather(rows) != gather(heads)
        differs = np.zeros(rows.size, dtype=bool)
        differs[np.repeat(np.arange(rows.size), lengths[rows])[unequal]] = True
    bad = np.flatnonzero(differs)
    if bad.size:
        row, other = int(rows[bad[0]]), int(heads[bad[0]])
        bag = lambda r: values[offsets[r]:offsets[r + 1]].tolist()  # noqa: E731
        log.fail(row, name, f"request {request_key[row].item()!r} has impressions with different "
                            f"values of {role} ({bag(other)} on {log.row_name(other)}, "
                            f"{bag(row)} here); a request's context is the same on all its "
                            f"impressions (impressions that differ: {bad.size})")


def _empty_ids(feature: Any) -> Any:
    import torch

    from gem_core.jagged import Jagged

    empty = torch.zeros(0, dtype=torch.int64)
    return Jagged(empty, torch.zeros(1, dtype=torch.int64)) if feature.multi_valued else empty


def _user_numbers(users: np.ndarray) -> np.ndarray:
    """Raw user ids as int64: the ids themselves when they are integers, else their rank."""
    if users.dtype.kind in "iu":
        return users.astype(np.int64)
    return np.arange(users.size, dtype=np.int64)


def import_logs(impressions: str | Path, events: str | Path, schema_file: str | Path,
                out: str | Path, *, row_group_rows: int = 16384) -> Any:
    """Import the logs into a data set directory ``out``; returns its manifest (its
    ``info["split"]`` says what share of the requests went to eval). Written beside ``out`` and
    renamed into place when complete: a failed import leaves ``out`` as it was."""
    from gem_data.writer import DatasetWriter, staged_directory

    schema, options = read_schema_file(schema_file)
    with staged_directory(out) as staging:
        splits, summary = _build(impressions, events, schema, options)
        info = {"source": "gem data import", "impressions": str(impressions),
                "events": str(events), "schema_file": str(schema_file),
                "import": attrs.asdict(options), "split": summary}
        writer = DatasetWriter(staging, schema, row_group_rows=row_group_rows, info=info)
        for split, batch in splits.items():
            batch.validate(schema, where=f"{out} ({split})")
            writer.write(split, batch)
        manifest = writer.close()
    return manifest


@click.command("import", help="Turn an impression log and an event log (Parquet or CSV) into a "
                              "request-level data set in OUT, with histories strictly before "
                              "each request. See docs/byod.md.")
@click.option("--impressions", type=click.Path(dir_okay=False), required=True,
              help="Impression log: one row per candidate shown, with labels.")
@click.option("--events", type=click.Path(dir_okay=False), required=True,
              help="Event log: one row per history event.")
@click.option("--schema", "schema_file", type=click.Path(dir_okay=False), required=True,
              help="Schema TOML: features, tables, tasks and an optional [import] table.")
@click.option("--out", type=click.Path(file_okay=False), required=True,
              help="Output data set directory.")
@click.option("--row-group-rows", type=click.IntRange(min=1), default=16384, show_default=True,
              help="Requests per Parquet row group.")
def import_command(impressions: str, events: str, schema_file: str, out: str,
                   row_group_rows: int) -> None:
    from gem_core.errors import GemError

    try:
        manifest = import_logs(impressions, events, schema_file, out,
                               row_group_rows=row_group_rows)
    except GemError as error:
        raise click.ClickException(str(error)) from None
    from gem_data.import_split import describe

    click.echo(f"wrote {manifest.rows('train')} train + {manifest.rows('eval')} eval requests "
               f"({manifest.tokens('train')} history events) to {out}; "
               f"{describe(manifest.info['split'])}")
