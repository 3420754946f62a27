"""What the DuckDB engine (:class:`~gem_data.import_duckdb.DuckDBImport`) does besides an import
when the logs are a time window (:mod:`gem_data.import_append`): refuse rows that are not later
than the window appended to, give the window's last time, and stream its history tail
(:mod:`gem_data.import_history`) out of DuckDB without holding it in memory. The earlier
windows' tail itself enters the histories in :meth:`DuckDBImport._histories`."""

from __future__ import annotations

from typing import Any, Iterator

from gem_data.format import event_column
from gem_data.import_duckdb_results import ResultRows, quote_identifier


def refuse_not_later(run: Any) -> None:
    """Stop at the first row (impressions, then events) at or before the last time of the
    window ``run`` appends to, naming file, row, time and that last time."""
    s, o, earlier = run.staged, run.options, run.earlier
    for view, log, role in (("imp", s.imp_log, "request time"), ("ev", s.ev_log, "event time")):
        row, count = run._one(f"SELECT min(row), count(*) FROM {view} WHERE t <= ?",
                              [earlier.last_time])
        if count:
            time = run._one(f"SELECT t FROM {view} WHERE row = ?", [row])[0]
            log.fail(int(row), o.timestamp_column, earlier.not_later(role, int(time), int(count)))


def last_time(run: Any) -> int:
    """The latest request or event time of the logs: every row, also those dropped (every
    row of a later window must be later)."""
    return int(run._one("SELECT max(t) FROM (SELECT t FROM imp UNION ALL SELECT t FROM ev)")[0])


def history_tail(run: Any, rows: int) -> Any:
    """The window's history tail: each user's last ``max_seq_len`` events of ``evs`` (the
    earlier windows' tail and the logs' events kept), by user number, time and row, as a reader
    of batches of about ``rows`` events. After :meth:`DuckDBImport.write` (which makes
    ``evs``), while ``run`` is open."""
    import pyarrow as pa

    from gem_data.import_history import TIME, tail_schema

    schema = run.schema
    target = tail_schema(schema)
    columns = "".join(f", e{j} AS {quote_identifier(event_column(f.name))}"
                      for j, f in enumerate(schema.event_features))
    query = (f"SELECT un AS user_id, t AS {quote_identifier(TIME)}{columns} FROM evs QUALIFY pos > "
             f"max(pos) OVER (PARTITION BY un) - {int(schema.max_seq_len)} ORDER BY un, pos")
    cursor = run.con.cursor()
    stream = ResultRows(cursor, run._sql_on(cursor, query).to_arrow_reader(rows), run.memory_limit)

    def batches() -> Iterator[Any]:
        try:
            while (table := stream.take(rows)) is not None:
                yield from table.cast(target).to_batches()
        finally:  # written to the end, failed or abandoned: the cursor is closed
            stream.close()

    return pa.RecordBatchReader.from_batches(target, batches())
