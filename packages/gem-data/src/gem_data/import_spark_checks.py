"""The checks over whole requests of the Spark engine (:class:`~gem_data.import_spark.SparkImport`),
and the two places it computes ids with gem-data's own Python functions.

The checks (:mod:`gem_data.import_request_checks`: the numpy path's, in its order, with its
messages) run after the tables ``live`` (the impressions kept, each with its request's head)
and ``req`` (one row per request) exist: one Spark job counts every check's failing rows, and
only a check whose count is not 0 asks for its first failing row (by request key, then row).

Request ids (:func:`~gem_data.import_requests.fold_ids`) and the numbers of text user ids
(:func:`~gem_data.import_requests.text_numbers`: their ``hash`` string ids) are computed in
Spark's Python workers by those very functions, as Arrow UDFs, so they are the numpy path's
bit for bit. The function is taken from its module when the UDF is made and travels with it,
so the workers run what this process would (a replaced one included).
"""

from __future__ import annotations

from typing import Any

from gem_data import import_requests
from gem_data.import_request_checks import (
    BAG,
    EQUAL,
    LENGTH,
    SAME,
    request_checks,
    stop_at_first_failure,
)
from gem_data.import_requests import key_name, same_id, same_user_number


def _failing(kind: str, column: str) -> Any:
    """The Spark condition of a row failing a check of ``kind`` on ``column``."""
    from pyspark.sql import functions as F

    here, head = F.col(column), F.col(f"head_{column}")
    if kind == SAME:
        return ~here.eqNullSafe(head)
    if kind == EQUAL:
        return here != head
    if kind == LENGTH:
        return F.size(here) != F.size(head)
    if kind == BAG:
        return F.array_sort(here) != F.array_sort(head)
    raise AssertionError(f"unknown check kind {kind!r}")


def check_requests(run: Any) -> None:
    """One user, one time and one context per request, and one 64-bit id per request key."""
    from pyspark.sql import functions as F

    checks = request_checks(run.schema, run.options, run.staged)
    conditions = {name: _failing(kind, column) for name, kind, column in checks}
    columns = {name: column for name, _, column in checks}
    counts: dict[str, int] = {}
    if checks:  # one pass over ``live`` counts every check's rows
        counts = run.live.agg(*[F.count_if(condition).alias(name)
                                for name, condition in conditions.items()]).first().asDict()

    def first(name: str) -> tuple[int, int, list[Any], Any, Any]:
        column = columns[name]
        found = (run.live.filter(conditions[name]).orderBy(*run.key, "row")
                 .select("row", "head", column, f"head_{column}", *run.key).first())
        return found[0], found[1], list(found[4:]), found[2], found[3]

    stop_at_first_failure(run.schema, run.options, run.staged, counts, first,
                          lambda: check_request_ids(run))


def check_request_ids(run: Any) -> None:
    """No two request keys with one 64-bit id (:meth:`RequestKeys.ids`); a key of one integer
    column cannot collide (splitmix64 is a bijection) and is not checked."""
    import numpy as np
    import pyarrow as pa
    from pyspark.sql import functions as F

    from gem_core.errors import GemDataError

    s = run.staged
    numbers = [_numbers(run, column) for column in run.key]
    if len(numbers) == 1 and numbers[0]:
        return
    fold = import_requests.fold_ids

    def request_ids(keys):  # no annotations: Spark reads a UDF's kind from them
        values = [column.to_numpy(zero_copy_only=False) for column in keys.flatten()]
        values = [v.astype(np.int64) if n else v.astype(str) for v, n in zip(values, numbers)]
        return pa.array(fold(values), pa.int64())

    # One pass when no two keys share an id (always, in practice); a second names them.
    ids = run.req.select(_arrow_udf(request_ids)(F.struct(*run.key)).alias("id"), *run.key)
    twice = ids.groupBy("id").count().filter("count > 1").orderBy("id").select("id").first()
    if twice is not None:
        keys = ids.filter(F.col("id") == twice[0]).orderBy(*run.key).select(*run.key).take(2)
        raise GemDataError(same_id(s.imp_log.path, key_name(s.key, list(keys[0])),
                                   key_name(s.key, list(keys[1])), int(twice[0])))


def user_numbers(run: Any) -> Any:
    """Every text user id of both logs with its number, ``(u, un)``, saved; two ids with one
    number stop the import, naming both."""
    import pyarrow as pa
    from pyspark.sql import functions as F

    from gem_core.errors import GemDataError

    numbers_of = import_requests.text_numbers

    def numbers(texts):  # no annotations: Spark reads a UDF's kind from them
        return pa.array(numbers_of(texts.to_numpy(zero_copy_only=False).astype(str)), pa.int64())

    users = run.imp.select("u").union(run.ev.select("u")).distinct()
    users = run.save("users", users.select("u", _arrow_udf(numbers)("u").alias("un")))
    twice = (users.groupBy("un").agg(F.count("*").alias("n"), F.min("u"), F.max("u"))
             .filter("n > 1").first())
    if twice is not None:
        raise GemDataError(same_user_number(
            f"column {run.options.user_column!r} of {run.impressions} and {run.events}: ",
            twice[2], twice[3], int(twice[0])))
    return users


def _arrow_udf(function: Any) -> Any:
    """``function`` (an Arrow array in, an int64 Arrow array out) as a Spark UDF."""
    from pyspark.sql.functions import arrow_udf

    return arrow_udf(function, "long")


def _numbers(run: Any, column: str) -> bool:
    """Whether the request key's column ``column`` (``u``, ``t``, ``k{i}``) holds numbers."""
    if column == "t":
        return True
    if column == "u":
        return run.user_numbers
    return run.staged.kinds[column].numbers
