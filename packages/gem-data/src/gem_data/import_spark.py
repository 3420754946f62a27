"""``gem data import --engine spark``: the join, the grouping, the checks and the split in Apache
Spark (PySpark), on this machine (``--master local[*]``, the default) or on a cluster
(``--master spark://...``, or ``spark-submit`` of :mod:`gem_data.spark_submit`).

It is the DuckDB engine's algorithm (:mod:`gem_data.import_duckdb`) step for step, so both
write what the numpy path writes. The logs are first staged by :mod:`gem_data.import_stage`
(read in blocks, every row converted and checked by the numpy path's code, written as typed
Parquet). Spark then, over the staged files:

- groups the impressions kept into requests by the request key
  (:mod:`gem_data.import_requests`), the first impression in the file heading each (the least
  ``row`` of the key, with its user, time and context), and runs the checks that need whole
  requests (:mod:`gem_data.import_spark_checks`) in the numpy path's order, with its messages;
- cuts train from eval by :func:`gem_data.import_split.choose_cut`, asking Spark for the times
  it needs;
- numbers each user's events kept by (time, row in the file) and counts, per request, the
  user's events strictly before its time (requests placed before events at one time); the
  history is the last ``max_seq_len`` of them. Users are keyed there by their stable number
  (text ids by their hash), which is also how a time window appended to a data set
  (:mod:`gem_data.import_append`) puts the earlier windows' history tail before the new events
  (:mod:`gem_data.import_spark_windows` writes the next);
- makes one row per request, its candidates and its history as arrays sorted by row and by
  event number, and writes the requests sorted by (time, first impression) as Parquet in the
  work directory (train's first: the cut is a time); they are read back part file by part
  file, in order, cut into row groups of ``row_group_rows`` and handed to
  :class:`~gem_data.writer.DatasetWriter`, each block checked as the numpy path checks its
  batches (:mod:`gem_data.import_spark_results`).

Every id is a LongType holding the int64 of the id's bits, never a float; where the numpy path
computes ids with a Python function (request ids, text user numbers), Spark's Python workers
run that function. Tables used more than once are written to the work directory and read back,
as DuckDB's tables are, so no step is computed twice. A Spark failure (out of memory, a full
disk, a failed job) is an error naming the engine and the option to change, not a traceback
(:mod:`gem_data.import_spark_session`, which also starts or finds the SparkSession).

On a cluster, the staged logs and Spark's results are files in the work directory
(``--temp-dir``): it must be a directory the driver and every executor see at the same path
(a shared file system), and the executors' Python must have gem-data installed.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from gem_data.import_options import ImportOptions
from gem_data.import_spark_checks import check_requests, user_numbers
from gem_data.import_spark_results import data_set_tables, part_files
from gem_data.import_spark_session import spark_errors, start_session
from gem_data.import_split import choose_cut
from gem_data.import_stage import import_report, stage_logs


class SparkImport:
    """One import on Spark: :meth:`prepare` stages the logs, checks the requests and cuts the
    split (returning the import's report), :meth:`write` streams the requests into a writer,
    :meth:`close` stops the session it started and removes the work directory."""

    def __init__(self, impressions: str | Path, events: str | Path, schema: Any,
                 options: ImportOptions, *, vocabularies: dict[str, Any] | None = None,
                 memory_limit: str | None = None, temp_dir: str | Path,
                 master: str | None = None, block_rows: int | None = None,
                 block_bytes: int | None = None, earlier: Any = None) -> None:
        self.impressions, self.events = Path(impressions), Path(events)
        self.earlier = earlier  # the Earlier windows this one follows (import_append), or None
        self.schema, self.options, self.given = schema, options, vocabularies
        self.memory_limit, self.master = memory_limit, master
        Path(temp_dir).mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="gem-import-", dir=temp_dir)).resolve()
        self.blocks = {k: v for k, v in (("block_rows", block_rows),
                                         ("block_bytes", block_bytes)) if v}
        self.spark: Any = None
        self.started = False
        self.cut: int | None = None

    def __enter__(self) -> SparkImport:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self.spark is not None and self.started:
            from py4j.protocol import Py4JError

            try:
                self.spark.stop()
            except Py4JError:  # the JVM is gone (killed, out of memory): nothing to stop
                pass
        self.spark = None
        shutil.rmtree(self.work, ignore_errors=True)

    def errors(self) -> Any:
        """A block whose Spark failures become one-line GemDataErrors."""
        return spark_errors(self.memory_limit, self.work)

    def save(self, name: str, frame: Any) -> Any:
        """``frame`` computed once into the work directory and read back from there."""
        path = str(self.work / name)
        frame.write.parquet(path)
        return self.spark.read.parquet(path)

    # -- preparing -------------------------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        """Stage, check and split; the import's report (as the numpy path's)."""
        # Spark first: a bad --master or --memory-limit stops the import before the staging.
        self.spark, self.started = start_session(self.master, self.memory_limit, self.work)
        if self.started:
            self.spark.sparkContext.setLogLevel("ERROR")
        self.staged = stage_logs(self.impressions, self.events, self.schema, self.options,
                                 self.work, vocabularies=self.given,
                                 users_as_text=self._earlier_user_text(), **self.blocks)
        with self.errors():
            self._views()
            if self.earlier is not None:
                from gem_data.import_spark_windows import refuse_not_later

                refuse_not_later(self)
            self._requests()
            check_requests(self)
            return self._report()

    def _report(self) -> dict[str, Any]:
        from pyspark.sql import Window
        from pyspark.sql import functions as F

        # Each request time with the requests up to it: the cut's questions are then one small
        # query each (an OFFSET into the requests would sort them, keeping as many as skipped).
        times = self.save("times", self.req.groupBy("rt").count().withColumn(
            "through", F.sum("count").over(Window.orderBy("rt").rowsBetween(
                Window.unboundedPreceding, Window.currentRow))))

        counts: dict[int, tuple[int, int]] = {}

        def around(t: int) -> tuple[int, int]:
            """Requests before ``t`` and through ``t``, asked once per time."""
            if t not in counts:
                row = times.agg(*[F.max(F.when(condition, F.col("through"))) for condition in
                                  (F.col("rt") < t, F.col("rt") <= t)]).first()
                counts[t] = (int(row[0] or 0), int(row[1] or 0))
            return counts[t]

        count = int(times.agg(F.max("through")).first()[0])
        self.cut, summary = choose_cut(
            count, self.options.eval_fraction,
            value_at=lambda i: times.filter(F.col("through") > i).agg(F.min("rt")).first()[0],
            before=lambda t: around(t)[0], through=lambda t: around(t)[1])
        all_requests = self.imp.select(*self.key).distinct().count()
        return import_report(self.staged, summary, requests=int(count),
                             all_requests=int(all_requests), user_numbers=self.user_numbers)

    def _earlier_user_text(self) -> bool | None:
        """How the data set appended to reads its users (None: not appending)."""
        return self.earlier.user_text if self.earlier is not None else None

    def _views(self) -> None:
        """``imp`` and ``ev``: the staged logs with the user as ``u`` (its number, or its text)
        and every other key column ``k{i}`` as numbers or text, as the whole column reads;
        ``key``: the request key's columns among ``u``, ``t`` and ``k{i}``."""
        from pyspark.sql import functions as F

        from gem_data.import_users import users_as_text

        s, o = self.staged, self.options
        self.user_numbers = not users_as_text(s, self._earlier_user_text(), o.user_column)
        user = F.col("u_n" if self.user_numbers else "u_s").alias("u")
        others = [c for c in s.key if c not in (o.user_column, o.timestamp_column)]
        self.key = ["u" if c == o.user_column else "t" if c == o.timestamp_column
                    else f"k{others.index(c)}" for c in s.key]
        keys = [F.col(f"k{i}_n" if s.kinds[f"k{i}"].numbers else f"k{i}_s").alias(f"k{i}")
                for i in range(len(others))]
        raw = {"u_n", "u_s", *(f"k{i}_{kind}" for i in range(len(others)) for kind in "ns")}
        imp = self.spark.read.parquet(str(s.impressions))
        self.imp = imp.select(*[c for c in imp.columns if c not in raw], user, *keys)
        ev = self.spark.read.parquet(str(s.events))
        self.ev = ev.select(*[c for c in ev.columns if c not in raw], user)

    def _requests(self) -> None:
        """``live``: the impressions kept, each with its request's head (first impression in
        the file) and the head's user, time and context; ``req``: one row per request."""
        from pyspark.sql import Window
        from pyspark.sql import functions as F

        context = [f"s{j}" for j in range(len(self.schema.sparse_features))]
        context += [f"d{j}" for j in range(len(self.options.dense_columns))]
        carried = ["u", "t", *context]
        # The head: the least row of the key, with that row's values (a struct's order is
        # its first field's, and rows are distinct).
        head = F.min(F.struct("row", *carried)).over(Window.partitionBy(*self.key))
        live = self.imp.filter("keep").withColumn("_head", head)
        live = live.select("*", F.col("_head.row").alias("head"),
                           *[F.col(f"_head.{c}").alias(f"head_{c}") for c in carried])
        self.live = self.save("live", live.drop("_head"))
        self.req = self.save("req", self.live.groupBy("head", *self.key).agg(
            F.any_value("head_u").alias("ru"), F.any_value("head_t").alias("rt"),
            *[F.any_value(f"head_{c}").alias(c) for c in context]))

    # -- writing ---------------------------------------------------------------------------------

    def _histories(self) -> None:
        """``req_un``: the requests with their user numbers; ``evs``: the events kept (after
        the earlier windows' tail, whose rows come first), numbered per user number by (time,
        row in the file) from 1; ``ends``: per request with a history, the number of its
        user's events strictly before its time (requests sort before the events of their
        time)."""
        from pyspark.sql import Window
        from pyspark.sql import functions as F

        events = [f"e{j}" for j in range(len(self.schema.event_features))]
        kept = self.ev.filter("keep").select("u", "t", "row", *events)
        req = self.req
        if self.user_numbers:
            kept = kept.withColumnRenamed("u", "un")
            req = req.withColumn("un", F.col("ru"))
        else:
            users = user_numbers(self)
            kept = kept.join(users, "u").drop("u")
            req = req.join(users.withColumnRenamed("u", "ru"), "ru")
        self.req_un = req  # the requests saved, with a column or a join of a saved table
        if self.earlier is not None:
            from gem_data.import_spark_windows import earlier_tail

            kept = earlier_tail(self).unionByName(kept)
        numbered = kept.withColumn("pos", F.row_number().over(
            Window.partitionBy("un").orderBy("t", "row")))
        self.evs = self.save("evs", numbered)
        merged = self.req_un.select("head", "rt", "un", F.col("rt").alias("t"),
                                    F.lit(0).alias("is_ev")).unionByName(
            self.evs.select(*[F.lit(None).cast("long").alias(c) for c in ("head", "rt")], "un",
                            "t", F.lit(1).alias("is_ev")))
        merged = merged.withColumn("e_end", F.sum("is_ev").over(
            Window.partitionBy("un").orderBy("t", "is_ev").rowsBetween(
                Window.unboundedPreceding, Window.currentRow)))
        self.ends = self.save("ends", merged.filter("is_ev = 0 AND e_end > 0").select(
            "head", "rt", "un", F.col("e_end").cast("long").alias("e_end")))

    def _requests_sorted(self) -> Any:
        """Every request as one row: ``user_id``, ``rt``, ``cands`` (the candidates' features
        and labels by row), ``hist`` (the history's times and event features, oldest first;
        null for none), the context; sorted by (time, head), so train's come before eval's."""
        from pyspark.sql import functions as F

        schema, o = self.schema, self.options
        length = int(schema.max_seq_len)
        candidates = ["row", *[f"c{j}" for j in range(len(schema.candidate_features))],
                      *[f"l{j}" for j in range(len(schema.tasks))],
                      *[f"cn{j}" for j in range(len(o.candidate_dense_columns))]]
        cands = self.live.groupBy("head").agg(
            F.sort_array(F.collect_list(F.struct(*candidates))).alias("cands"))
        start = F.greatest(F.col("e_end") - length, F.lit(0)) + 1
        wanted = (self.ends.filter(start <= F.col("e_end"))
                  .select("head", "un", F.explode(F.sequence(start, F.col("e_end"))).alias("pos")))
        events = ["pos", "t", *[f"e{j}" for j in range(len(schema.event_features))]]
        hist = wanted.join(self.evs, ["un", "pos"]).groupBy("head").agg(
            F.sort_array(F.collect_list(F.struct(*events))).alias("hist"))
        context = [f"s{j}" for j in range(len(schema.sparse_features))]
        context += [f"d{j}" for j in range(len(o.dense_columns))]
        return (self.req_un.select("head", "rt", F.col("un").alias("user_id"), *context)
                .join(cands, "head").join(hist, "head", "left").orderBy("rt", "head"))

    def write(self, writer: Any, where: str, row_group_rows: int) -> None:
        """Stream every split's requests into ``writer``, checked block by block."""
        from gem_data.arrow_io import table_to_batch

        path = self.work / "requests"
        with self.errors():
            self._histories()
            self._requests_sorted().write.parquet(str(path))
        for split, table in data_set_tables(part_files(path), self.schema, self.options,
                                            row_group_rows, self.cut):
            table_to_batch(table, self.schema).validate(self.schema, where=f"{where} ({split})")
            writer.write(split, table)

    def engine_info(self) -> dict[str, Any]:
        context = self.spark.sparkContext
        return {"name": "spark", "version": self.spark.version, "master": context.master,
                "driver_memory": context.getConf().get("spark.driver.memory", "1g"),
                "default_parallelism": int(context.defaultParallelism)}
