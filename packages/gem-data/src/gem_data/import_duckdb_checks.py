"""The checks of the DuckDB engine (:class:`~gem_data.import_duckdb.DuckDBImport`) that need
whole requests, run after its tables ``live`` (the impressions kept, each with its request's
head) and ``req`` (one row per request) exist.

They are the numpy path's checks (:func:`gem_data.import_build._build`), asked of DuckDB as
counts and, only when a count is not 0, the first offending row: in the numpy path's order
(user, time, request ids, context bags, dense context), naming the row it names (the first in
request key order, then in file order), with its messages
(:mod:`gem_data.import_requests`), so both engines fail a bad log alike.
"""

from __future__ import annotations

from typing import Any

from gem_data.import_requests import (
    fold_ids,
    key_name,
    mixed_context,
    mixed_dense,
    mixed_request,
    same_id,
)


def check_requests(run: Any) -> None:
    """One user, one time and one context per request, and one 64-bit id per request key."""
    schema, o, s = run.schema, run.options, run.staged
    checks: list[tuple[str, str]] = []  # (name, condition)
    if o.user_column not in s.key:
        checks.append(("user", "u IS DISTINCT FROM head_u"))
    if o.timestamp_column not in s.key:
        checks.append(("time", "t <> head_t"))
    for j in range(len(schema.sparse_features)):
        checks.append((f"length{j}", f"len(s{j}) <> len(head_s{j})"))
        checks.append((f"bag{j}", f"list_sort(s{j}) <> list_sort(head_s{j})"))
    for j in range(len(o.dense_columns)):
        checks.append((f"dense{j}", f"d{j} <> head_d{j}"))
    counts = {}
    if checks:  # one pass over ``live`` counts every check's rows
        row = run._one("SELECT " + ", ".join(f"count(*) FILTER (WHERE {condition})"
                                             for _, condition in checks) + " FROM live")
        counts = dict(zip([name for name, _ in checks], row))
    conditions = dict(checks)

    def first(condition: str, columns: str) -> Any:
        found = run._one(f"SELECT row, head, {columns}, {run.key} FROM live WHERE "
                         f"{condition} ORDER BY {run.key}, row LIMIT 1")
        return (found[0], found[1], list(found[4:]), found[2], found[3])

    def request_name(values: list[Any]) -> str:
        return key_name(s.key, values)

    imp = s.imp_log
    for name, column, role, raw in (("user", o.user_column, "user", "u"),
                                    ("time", o.timestamp_column, "request time", "t")):
        if counts.get(name):
            row, head, key, here, other = first(conditions[name], f"{raw}, head_{raw}")
            imp.fail(row, column, mixed_request(request_name(key), role, other, here))
    check_request_ids(run)
    for j, feature in enumerate(schema.sparse_features):
        name = f"length{j}" if counts[f"length{j}"] else f"bag{j}"
        if counts[name]:
            row, head, key, here, other = first(conditions[name], f"s{j}, head_s{j}")
            imp.fail(row, o.columns.get(f"sparse.{feature.name}", feature.name),
                     mixed_context(request_name(key), f"context feature "
                                   f"{feature.name!r}", other, imp.row_name(head), here,
                                   int(counts[name])))
    for j, column in enumerate(o.dense_columns):
        if counts[f"dense{j}"]:
            row, head, key, here, other = first(conditions[f"dense{j}"], f"d{j}, head_d{j}")
            imp.fail(row, column, mixed_dense(request_name(key), column, other,
                                              imp.row_name(head), here))


def check_request_ids(run: Any) -> None:
    """No two request keys with one 64-bit id (:meth:`RequestKeys.ids`), the ids computed by
    the numpy path's :func:`~gem_data.import_requests.fold_ids` as a DuckDB function."""
    import pyarrow as pa

    from gem_core.errors import GemDataError

    s = run.staged
    numbers = [_numbers(run, i) for i in range(len(s.key))]
    if len(s.key) == 1 and numbers[0]:
        return  # one integer column: splitmix64 is a bijection, no two keys share an id

    def request_id(keys: Any) -> Any:
        keys = keys.combine_chunks() if hasattr(keys, "combine_chunks") else keys
        values = [keys.field(i).to_numpy(zero_copy_only=False) for i in range(len(numbers))]
        values = [v if n else v.astype(str) for v, n in zip(values, numbers)]
        return pa.array(fold_ids(values), pa.int64())

    struct = ", ".join(f"f{i} {'BIGINT' if n else 'VARCHAR'}" for i, n in enumerate(numbers))
    run.con.create_function("gem_request_id", request_id, [f"STRUCT({struct})"], "BIGINT",
                            type="arrow", side_effects=False)
    fields = ", ".join(f"'f{i}': {e}" for i, e in enumerate(run.key_exprs))
    run._sql(f"CREATE TABLE ids AS SELECT gem_request_id({{{fields}}}) AS id, {run.key} "
             "FROM req")
    twice = run._one("SELECT id FROM ids GROUP BY id HAVING count(*) > 1 ORDER BY id "
                     "LIMIT 1")
    if twice:
        keys = run._sql(f"SELECT {run.key} FROM ids WHERE id = ? ORDER BY {run.key} "
                        "LIMIT 2", [twice[0]]).fetchall()
        raise GemDataError(same_id(s.imp_log.path, key_name(s.key, list(keys[0])),
                                   key_name(s.key, list(keys[1])), int(twice[0])))


def _numbers(run: Any, index: int) -> bool:
    """Whether the key's ``index``-th column holds numbers (else text)."""
    o, s = run.options, run.staged
    column = s.key[index]
    if column == o.timestamp_column:
        return True
    if column == o.user_column:
        return run.user_numbers
    return s.kinds[run.key_exprs[index]].numbers
