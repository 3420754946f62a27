"""The checks over whole requests of an engine that groups requests out of core
(:mod:`gem_data.import_spark_checks`; :mod:`gem_data.import_duckdb_checks` runs the same ones in
SQL), said once, apart from how the engine answers them.

Each check compares a column of every impression kept with the same column of its request's
head (the first impression in the file): :func:`request_checks` lists them in the numpy
path's order (user, time, context bags, dense context; the request ids are checked between the
time and the context, by the engine); the engine counts the rows failing each and, for a check
whose count is not 0, finds the first failing row (in request key order, then in file order);
:func:`stop_at_first_failure` turns those answers into the numpy path's error
(:mod:`gem_data.import_requests`).
"""

from __future__ import annotations

from typing import Any, Callable

from gem_data.import_requests import key_name, mixed_context, mixed_dense, mixed_request

SAME = "same"
"""A check kind: the values are the same, a missing value equal to a missing value."""
EQUAL = "equal"
"""A check kind: the values are equal (a missing value fails no row)."""
LENGTH = "length"
"""A check kind: the lists have the same length."""
BAG = "bag"
"""A check kind: the lists hold the same values, in any order (each list sorted, compared)."""

#: ``first(name)``: the first row failing check ``name``: (row, head, key values, value on that
#: row, value on the head).
FirstRow = Callable[[str], tuple[int, int, list[Any], Any, Any]]


def request_checks(schema: Any, options: Any, staged: Any) -> list[tuple[str, str, str]]:
    """``(name, kind, column)`` of every check, in the order their errors are raised: the user
    and the time (unless they key the request), then each context feature's bag (``s{j}``:
    its length first) and each dense column (``d{j}``); the head's column is ``head_`` and the
    column."""
    checks = []
    if options.user_column not in staged.key:
        checks.append(("user", SAME, "u"))
    if options.timestamp_column not in staged.key:
        checks.append(("time", EQUAL, "t"))
    for j in range(len(schema.sparse_features)):
        checks += [(f"length{j}", LENGTH, f"s{j}"), (f"bag{j}", BAG, f"s{j}")]
    checks += [(f"dense{j}", EQUAL, f"d{j}") for j in range(len(options.dense_columns))]
    return checks


def stop_at_first_failure(schema: Any, options: Any, staged: Any, counts: dict[str, int],
                          first: FirstRow, check_request_ids: Callable[[], None]) -> None:
    """Raise the numpy path's error for the first check, in :func:`request_checks`' order,
    that some row fails (``counts``: rows failing each check; ``first``: the first of them);
    ``check_request_ids`` runs between the time and the context checks, as in the numpy
    path."""
    o, imp = options, staged.imp_log

    def request(values: list[Any]) -> str:
        return key_name(staged.key, values)

    for name, column, role in (("user", o.user_column, "user"),
                               ("time", o.timestamp_column, "request time")):
        if counts.get(name):
            row, _, key, here, other = first(name)
            imp.fail(row, column, mixed_request(request(key), role, other, here))
    check_request_ids()
    for j, feature in enumerate(schema.sparse_features):
        name = f"length{j}" if counts[f"length{j}"] else f"bag{j}"
        if counts[name]:
            row, head, key, here, other = first(name)
            imp.fail(row, o.columns.get(f"sparse.{feature.name}", feature.name),
                     mixed_context(request(key), f"context feature {feature.name!r}", other,
                                   imp.row_name(head), here, int(counts[name])))
    for j, column in enumerate(o.dense_columns):
        if counts[f"dense{j}"]:
            row, head, key, here, other = first(f"dense{j}")
            imp.fail(row, column, mixed_dense(request(key), column, other, imp.row_name(head),
                                              here))
