"""What the Spark engine (:class:`~gem_data.import_spark.SparkImport`) does besides an import when
the logs are a time window (:mod:`gem_data.import_append`), as the DuckDB engine does
(:mod:`gem_data.import_duckdb_windows`): refuse rows that are not later than the window
appended to, put the earlier windows' history tail before the new events, give the window's
last time, and write its own history tail (:mod:`gem_data.import_history`) without holding it
in memory."""

from __future__ import annotations

from typing import Any

from gem_data.format import event_column


def refuse_not_later(run: Any) -> None:
    """Stop at the first row (impressions, then events) at or before the last time of the
    window ``run`` appends to, naming file, row, time and that last time."""
    from pyspark.sql import functions as F

    s, o, earlier = run.staged, run.options, run.earlier
    for frame, log, role in ((run.imp, s.imp_log, "request time"),
                             (run.ev, s.ev_log, "event time")):
        row, count = frame.filter(F.col("t") <= earlier.last_time).agg(
            F.min("row"), F.count("*")).first()
        if count:
            time = frame.filter(F.col("row") == row).select("t").first()[0]
            log.fail(int(row), o.timestamp_column, earlier.not_later(role, int(time), int(count)))


def earlier_tail(run: Any) -> Any:
    """The earlier windows' history tail as events kept (``un``, ``t``, ``row``, ``e{j}``),
    their rows numbered before every row of the logs (from minus the tail's length), in the
    tail's order."""
    from pyspark.sql import functions as F

    from gem_data.import_history import TIME

    tail = run.spark.read.parquet(str(run.earlier.tail))
    rows = tail.count()
    return tail.select(F.col("user_id").alias("un"), F.col(TIME).alias("t"),
                       (F.col("_metadata.row_index") - rows).alias("row"),
                       *[F.col(f"`{event_column(f.name)}`").alias(f"e{j}")
                         for j, f in enumerate(run.schema.event_features)])


def last_time(run: Any) -> int:
    """The latest request or event time of the logs: every row, also those dropped (every
    row of a later window must be later)."""
    from pyspark.sql import functions as F

    with run.errors():
        return int(run.imp.select("t").union(run.ev.select("t")).agg(F.max("t")).first()[0])


def history_tail(run: Any, rows: int) -> Any:
    """The window's history tail: each user's last ``max_seq_len`` events of ``evs`` (the
    earlier windows' tail and the logs' events kept), by user number, time and row, as a reader
    of batches of ``rows`` events. After :meth:`SparkImport.write` (which makes ``evs``), while
    ``run`` is open."""
    import pyarrow as pa
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    from gem_data.import_history import TIME, tail_schema
    from gem_data.import_spark_results import blocks, part_files

    schema = run.schema
    target = tail_schema(schema)
    latest = F.max("pos").over(Window.partitionBy("un"))
    tail = (run.evs.withColumn("latest", latest)
            .filter(F.col("pos") > F.col("latest") - int(schema.max_seq_len))
            .orderBy("un", "pos")
            .select(F.col("un").alias("user_id"), F.col("t").alias(TIME),
                    *[F.col(f"e{j}").alias(f"e{j}") for j in range(len(schema.event_features))]))
    path = run.work / "history-tail"
    with run.errors():
        tail.write.parquet(str(path))
    tables = blocks(part_files(path), rows)
    return pa.RecordBatchReader.from_batches(target, (
        batch for _, table in tables
        for batch in pa.Table.from_arrays(table.columns, names=target.names).cast(target)
        .to_batches()))
