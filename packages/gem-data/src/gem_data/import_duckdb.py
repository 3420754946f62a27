"""``gem data import --engine duckdb``: the join, the grouping and the split in DuckDB, embedded and
out of core (``--memory-limit``; what does not fit spills to ``--temp-dir``).

The logs are first staged by :mod:`gem_data.import_stage` (read in blocks, every row converted
and checked by the numpy path's code; two ``hash`` texts with one id found across blocks). Side
tables (``[[import.join]]``) are staged into DuckDB too and looked up for each block by its keys
(:mod:`gem_data.import_duckdb_side`), never read whole. DuckDB then, over the staged Parquet
files:

- groups the impressions kept into requests by the request key
  (:mod:`gem_data.import_requests`), the first impression in the file heading each, and runs
  the checks that need whole requests (:mod:`gem_data.import_duckdb_checks`), in the numpy
  path's order and with its messages: one user and one time per request, no two keys with one
  64-bit request id (computed by the numpy path's function,
  :func:`~gem_data.import_requests.fold_ids`, as a DuckDB function; a key of one integer column
  cannot collide and is not checked), the same context on every impression;
- cuts train from eval by :func:`gem_data.import_split.choose_cut`, asking DuckDB for the
  times it needs;
- numbers each user's events kept by (time, row in the file) and counts, per request, the
  user's events strictly before its time (requests placed before events at one time); the
  history is the last ``max_seq_len`` of them, oldest first, joined into a table of its own
  before it is sorted (in one query, DuckDB 1.5.6 ran out of memory where each part alone
  spills). Users are keyed there by their
  stable number (:func:`~gem_data.import_requests.user_numbers`: text ids by their hash, as a
  DuckDB function), which is also how a time window appended to a data set
  (:mod:`gem_data.import_append`) adds the earlier windows' history tail, read by DuckDB from
  its Parquet file, before the new events (:mod:`gem_data.import_duckdb_windows` writes the
  next);
- returns the requests by (time, first impression), which are cut into row groups of
  ``row_group_rows`` and handed to :class:`~gem_data.writer.DatasetWriter` block by block,
  each block checked as the numpy path checks its batches.

What spills: DuckDB writes what does not fit under ``--memory-limit`` to ``--temp-dir`` from its
hash joins (the histories), sorts (the three streams of requests, candidates and history
events, held sorted while they are written) and aggregates (the requests); its window
functions (each request's head, each user's events numbered and counted) partition and sort
out of core too. A test (``test_import_duckdb_out_of_core``) imports under 80 MB on two threads
a log whose histories are over 100 MB and sees tens of MB in DuckDB's temporary files mid-way
(:data:`on_block`, :meth:`DuckDBImport.temporary_files`). The least memory an import needs grows
with ``--threads`` (each thread holds buffers of its own): under 60 MB, two threads ran out of
memory on that log where one did not.

Every id is a BIGINT holding the int64 of the id's bits (uint64 ids were reinterpreted at
staging, as the numpy path does), never a float. Where an error names the first offending row
of several, it is the one the numpy path names: the first in request key order, then in file
order. A DuckDB failure (out of memory under the limit, a full disk) is an error naming the
engine and the option to change, not a traceback.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

from gem_data.format import event_column as fmt_event
from gem_data.import_duckdb_checks import check_requests
from gem_data.import_duckdb_results import ResultRows, quote_identifier
from gem_data.import_options import ImportOptions
from gem_data.import_split import choose_cut
from gem_data.import_stage import import_report, stage_logs

#: The DuckDB release gem-data is tested with (``gem-data[duckdb]`` pins it).
DUCKDB_VERSION = "1.5.6"

#: Called with the running :class:`DuckDBImport` after each block of requests is laid out,
#: while DuckDB's sorted streams are open (what did not fit under the memory limit is then in
#: its temporary files, :meth:`DuckDBImport.temporary_files`): how a test looks inside an
#: import mid-way. None outside tests.
on_block: Callable[[DuckDBImport], None] | None = None


def _literal(text: str | Path) -> str:
    return "'" + str(text).replace("'", "''") + "'"


def connect(memory_limit: str | None, work: Path, threads: int | None = None) -> Any:
    """A DuckDB connection on a database file in ``work``, spilling there, under
    ``memory_limit`` (DuckDB's syntax: ``2GB``, ``512MiB``; None: DuckDB's default, 80 % of
    the memory)."""
    from gem_core.errors import GemDataError

    try:
        import duckdb
    except ImportError:
        raise GemDataError("--engine duckdb needs the duckdb package: pip install "
                           f"'gem-data[duckdb]' (duckdb=={DUCKDB_VERSION})") from None
    con = duckdb.connect(str(work / "import.duckdb"))
    try:
        con.execute(f"SET temp_directory = {_literal(work / 'spill')}")
        con.execute("SET preserve_insertion_order = false")
        if threads:
            con.execute(f"SET threads = {int(threads)}")
    except duckdb.Error as error:
        con.close()
        raise GemDataError(f"DuckDB: {error}") from None
    if memory_limit is not None:
        try:
            con.execute(f"SET memory_limit = {_literal(memory_limit)}")
        except duckdb.Error as error:
            con.close()
            raise GemDataError(f"--memory-limit {memory_limit!r} is not a size DuckDB reads "
                               f"(write it as 2GB, 512MB or 1.5GiB): {error}") from None
    return con


class DuckDBImport:
    """One import on DuckDB: :meth:`prepare` stages the logs, checks the requests and cuts the
    split (returning the import's report), :meth:`write` streams the requests into a writer,
    :meth:`close` removes the work directory (the spill files and the database)."""

    def __init__(self, impressions: str | Path, events: str | Path, schema: Any,
                 options: ImportOptions, *, vocabularies: dict[str, Any] | None = None,
                 memory_limit: str | None = None, temp_dir: str | Path,
                 threads: int | None = None, block_rows: int | None = None,
                 block_bytes: int | None = None, earlier: Any = None) -> None:
        self.impressions, self.events = Path(impressions), Path(events)
        self.earlier = earlier  # the Earlier windows this one follows (import_append), or None
        self.schema, self.options, self.given = schema, options, vocabularies
        self.memory_limit = memory_limit
        Path(temp_dir).mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="gem-import-", dir=temp_dir))
        self.blocks = {k: v for k, v in (("block_rows", block_rows),
                                         ("block_bytes", block_bytes)) if v}
        self.con: Any = None
        self.threads = threads
        self.cut: int | None = None

    def __enter__(self) -> DuckDBImport:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self.con is not None:
            self.con.close()
            self.con = None
        shutil.rmtree(self.work, ignore_errors=True)

    # -- SQL -------------------------------------------------------------------------------------

    def _sql(self, query: str, parameters: list[Any] | None = None) -> Any:
        """Run ``query``; a DuckDB error becomes a GemDataError naming the engine."""
        import duckdb

        from gem_core.errors import GemDataError

        try:
            return self.con.execute(query, parameters or [])
        except duckdb.OutOfMemoryException as error:
            limit = self.con.execute("SELECT current_setting('memory_limit')").fetchone()[0]
            raise GemDataError(f"DuckDB ran out of memory under its memory limit ({limit}; "
                               f"--memory-limit {self.memory_limit or 'not given'}): raise "
                               "--memory-limit, or point --temp-dir at a disk with room to "
                               f"spill ({str(error).splitlines()[0]})") from None
        except duckdb.Error as error:
            raise GemDataError(f"DuckDB ({type(error).__name__}): {error}; its work directory "
                               f"was {self.work} (--temp-dir)") from None

    def _one(self, query: str, parameters: list[Any] | None = None) -> Any:
        return self._sql(query, parameters).fetchone()

    # -- preparing -------------------------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        """Stage, check and split; the import's report (as the numpy path's)."""
        from gem_data.import_duckdb_side import SideStore

        self.con = connect(self.memory_limit, self.work, self.threads)  # a bad limit: at once
        self.staged = stage_logs(self.impressions, self.events, self.schema, self.options,
                                 self.work, vocabularies=self.given,
                                 users_as_text=self._earlier_user_text(),
                                 side_store=SideStore(self), **self.blocks)
        self._views()
        if self.earlier is not None:
            from gem_data.import_duckdb_windows import refuse_not_later

            refuse_not_later(self)
        self._requests()
        check_requests(self)
        count = self._one("SELECT count(*) FROM req")[0]
        self.cut, summary = choose_cut(
            count, self.options.eval_fraction,
            value_at=lambda i: self._one("SELECT rt FROM req ORDER BY rt LIMIT 1 OFFSET ?",
                                         [i])[0],
            before=lambda t: self._one("SELECT count(*) FROM req WHERE rt < ?", [t])[0],
            through=lambda t: self._one("SELECT count(*) FROM req WHERE rt <= ?", [t])[0])
        all_requests = self._one(f"SELECT count(*) FROM (SELECT DISTINCT {self.key} FROM imp)")[0]
        return import_report(self.staged, summary, requests=int(count),
                             all_requests=int(all_requests), user_numbers=self.user_numbers)

    def _earlier_user_text(self) -> bool | None:
        """How the data set appended to reads its users (None: not appending)."""
        return self.earlier.user_text if self.earlier is not None else None

    def _views(self) -> None:
        from gem_data.import_users import users_as_text

        s, o = self.staged, self.options
        numbers = not users_as_text(s, self._earlier_user_text(), o.user_column)
        user = "u_n" if numbers else "u_s"
        self.user_numbers = numbers
        others = [c for c in s.key if c not in (o.user_column, o.timestamp_column)]
        keys = []
        for column in s.key:
            if column == o.user_column:
                keys.append("u")
            elif column == o.timestamp_column:
                keys.append("t")
            else:
                keys.append(f"k{others.index(column)}")
        self.key_exprs = keys
        self.key = ", ".join(keys)
        k_columns = "".join(f", {'k%d_n' % i if s.kinds[f'k{i}'].numbers else 'k%d_s' % i} "
                            f"AS k{i}" for i in range(len(others)))
        self._sql(f"CREATE VIEW imp AS SELECT * EXCLUDE (u_n, u_s"
                  f"{''.join(f', k{i}_n, k{i}_s' for i in range(len(others)))}), "
                  f"{user} AS u{k_columns} FROM read_parquet({_literal(s.impressions)})")
        self._sql(f"CREATE VIEW ev AS SELECT * EXCLUDE (u_n, u_s), {user} AS u "
                  f"FROM read_parquet({_literal(s.events)})")

    def _requests(self) -> None:
        """``live``: the impressions kept, each with its request's head (first impression in
        the file) and the head's user, time and context; ``req``: one row per request."""
        schema, o = self.schema, self.options
        heads = ["first_value(row) OVER w AS head", "first_value(u) OVER w AS head_u",
                 "first_value(t) OVER w AS head_t"]
        heads += [f"first_value(s{j}) OVER w AS head_s{j}"
                  for j in range(len(schema.sparse_features))]
        heads += [f"first_value(d{j}) OVER w AS head_d{j}" for j in range(len(o.dense_columns))]
        self._sql(f"CREATE TABLE live AS SELECT *, {', '.join(heads)} FROM imp WHERE keep "
                  f"WINDOW w AS (PARTITION BY {self.key} ORDER BY row)")
        context = "".join(f", any_value(head_s{j}) AS s{j}"
                          for j in range(len(schema.sparse_features)))
        context += "".join(f", any_value(head_d{j}) AS d{j}" for j in range(len(o.dense_columns)))
        self._sql(f"CREATE TABLE req AS SELECT head, any_value(head_u) AS ru, "
                  f"any_value(head_t) AS rt, count(*) AS n{context}, {self.key} FROM live "
                  f"GROUP BY head, {self.key}")

    # -- writing ---------------------------------------------------------------------------------

    def _histories(self) -> None:
        """``users`` (text user ids only): each user's number; ``evs``: the events kept (after
        the earlier windows' tail, whose rows come first), numbered per user number by (time,
        row in the file) from 1; ``ends``: per request with a history, the number of its
        user's events strictly before its time (requests sort before the events of their
        time); ``hist``: every request's history events (the last ``max_seq_len`` before
        ``e_end``), unsorted."""
        from gem_data.import_history import TIME
        from gem_data.import_requests import same_user_number

        schema = self.schema
        events = "".join(f"e{j}, " for j in range(len(schema.event_features)))
        if not self.user_numbers:
            self._user_numbers()
            twice = self._one("SELECT un, min(u), max(u) FROM users GROUP BY un HAVING "
                              "count(*) > 1 LIMIT 1")
            if twice:
                from gem_core.errors import GemDataError

                raise GemDataError(same_user_number(
                    f"column {self.options.user_column!r} of {self.impressions} and "
                    f"{self.events}: ", twice[1], twice[2], int(twice[0])))
        number, users = ("u", "") if self.user_numbers else \
            ("n.un", " JOIN users n ON n.u = ev.u")
        from_ev = "".join(f", ev.e{j}" for j in range(len(schema.event_features)))
        from_events = "".join(f", e.e{j}" for j in range(len(schema.event_features)))
        kept = f"SELECT {number} AS un, ev.t, ev.row{from_ev} FROM ev{users} WHERE ev.keep"
        if self.earlier is not None:  # before every event of the logs: rows from -(tail rows)
            tail = _literal(self.earlier.tail)
            rows = self._one(f"SELECT count(*) FROM read_parquet({tail})")[0]
            columns = "".join(f", {quote_identifier(fmt_event(f.name))}"
                              for f in schema.event_features)
            kept += (f" UNION ALL SELECT user_id, {quote_identifier(TIME)}, "
                     f"file_row_number - {rows}{columns} "
                     f"FROM read_parquet({tail}, file_row_number = true)")
        self._sql(f"CREATE TABLE evs AS SELECT un, t, row, {events}row_number() OVER "
                  f"(PARTITION BY un ORDER BY t, row) AS pos FROM ({kept})")
        requests = "SELECT head, rt, ru AS un FROM req" if self.user_numbers else \
            "SELECT r.head, r.rt, n.un FROM req r JOIN users n ON n.u = r.ru"
        self._sql("CREATE TABLE ends AS SELECT head, rt, un, e_end::BIGINT AS e_end FROM (SELECT "
                  "head, rt, un, is_ev, sum(is_ev) OVER (PARTITION BY un ORDER BY t, is_ev ROWS "
                  "BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS e_end FROM (SELECT head, rt, "
                  f"un, rt AS t, 0 AS is_ev FROM ({requests}) UNION ALL SELECT NULL, NULL, un, "
                  "t, 1 FROM evs)) WHERE is_ev = 0 AND e_end > 0")
        # Joined here, apart from the sort that streams them (_streams): a join feeding a sort
        # keeps its hash table pinned while the sort fills memory, and DuckDB 1.5.6 then ran out
        # of memory under limits (60MB on two threads) that each needs alone, spilling.
        length = int(schema.max_seq_len)
        self._sql(f"CREATE TABLE hist AS SELECT x.head, x.rt, e.pos, e.t{from_events} FROM ("
                  f"SELECT head, rt, un, unnest(range(greatest(e_end - {length}, 0) + 1, e_end "
                  "+ 1)) AS pos FROM ends) x JOIN evs e ON e.un = x.un AND e.pos = x.pos")

    def _user_numbers(self) -> None:
        """``users``: every text user id of both logs with its number (the numpy path's
        :func:`~gem_data.import_requests.user_numbers`, as a DuckDB function; collisions are
        found over the whole table by the caller)."""
        import pyarrow as pa

        from gem_data.import_requests import text_numbers

        def numbers(texts: Any) -> Any:
            texts = texts.combine_chunks() if hasattr(texts, "combine_chunks") else texts
            return pa.array(text_numbers(texts.to_numpy(zero_copy_only=False).astype(str)),
                            pa.int64())

        self.con.create_function("gem_user_number", numbers, ["VARCHAR"], "BIGINT",
                                 type="arrow", side_effects=False)
        self._sql("CREATE TABLE users AS SELECT u, gem_user_number(u) AS un FROM (SELECT u FROM "
                  "imp UNION SELECT u FROM ev)")

    def _streams(self, split: str) -> tuple[str, str, str]:
        """The three queries of a split's requests, each in request order (time, then first
        impression): one row per request, per candidate, per history event."""
        schema, o = self.schema, self.options
        length = int(schema.max_seq_len)

        def keep(time: str) -> str:
            if self.cut is None:
                return "TRUE" if split == "train" else "FALSE"
            return f"{time} {'>=' if split == 'eval' else '<'} {int(self.cut)}"

        user = "r.ru" if self.user_numbers else "n.un"
        users = "" if self.user_numbers else " JOIN users n ON n.u = r.ru"
        context = "".join(f", r.s{j}" for j in range(len(schema.sparse_features)))
        context += "".join(f", r.d{j}::FLOAT AS d{j}" for j in range(len(o.dense_columns)))
        requests = (f"SELECT r.head, r.rt, {user} AS user_id, r.n, least(coalesce(x.e_end, "
                    f"0), {length}) AS h{context} FROM req r{users} LEFT JOIN ends x ON x.head = "
                    f"r.head WHERE {keep('r.rt')} ORDER BY r.rt, r.head")
        features = "".join(f", c{j}" for j in range(len(schema.candidate_features)))
        features += "".join(f", l{j}" for j in range(len(schema.tasks)))
        features += "".join(f", cn{j}" for j in range(len(o.candidate_dense_columns)))
        candidates = (f"SELECT head{features} FROM live WHERE {keep('head_t')} "
                      "ORDER BY head_t, head, row")
        events = "".join(f", e{j}" for j in range(len(schema.event_features)))
        history = f"SELECT head, t{events} FROM hist WHERE {keep('rt')} ORDER BY rt, head, pos"
        return requests, candidates, history

    def tables(self, split: str, rows: int) -> Iterator[Any]:
        """The requests of ``split`` in order, as tables of ``rows`` requests (the last one
        fewer) with the data set's arrow schema: DuckDB sorts the three streams of
        :meth:`_streams` (out of core), this lays their rows into the data set's lists."""
        import numpy as np
        import pyarrow as pa

        from gem_data import format as fmt

        schema, o = self.schema, self.options
        target = fmt.arrow_schema(schema)
        queries = self._streams(split)
        # Three cursors: three results streaming at once (DuckDB's memory limit is shared).
        streams = []
        try:
            for query in queries:
                cursor = self.con.cursor()
                streams.append(ResultRows(
                    cursor, self._sql_on(cursor, query).to_arrow_reader(rows), self.memory_limit))
        except BaseException:  # a failed query or an interrupt: close what opened, re-raise
            for stream in streams:
                stream.close()
            raise
        requests, candidates, history = streams
        try:
            while True:
                block = requests.take(rows)
                if block is None:
                    return
                heads = block.column("head").to_numpy()
                n = block.column("n").to_numpy()
                h = block.column("h").to_numpy()
                cands = candidates.take(int(n.sum()))
                events = history.take(int(h.sum()))
                for part, counts in ((cands, n), (events, h)):
                    got = np.zeros(0) if part is None else part.column("head").to_numpy()
                    if not np.array_equal(got, np.repeat(heads, counts)):
                        raise AssertionError("DuckDB's streams of one split are out of step")

                def lists(part: Any, counts: np.ndarray, column: str) -> Any:
                    offsets = np.zeros(counts.size + 1, dtype=np.int32)
                    np.cumsum(counts, out=offsets[1:])
                    values = part.column(column).combine_chunks() if part is not None else \
                        pa.array([], pa.int64())
                    return pa.ListArray.from_arrays(pa.array(offsets), values)

                columns = [block.column("user_id"), block.column("rt"),
                           lists(events, h, "t")]
                columns += [lists(events, h, f"e{j}") if events is not None else
                            pa.array([[]] * len(heads), target.field(
                                fmt.event_column(f.name)).type)
                            for j, f in enumerate(schema.event_features)]
                columns += [lists(cands, n, f"c{j}")
                            for j in range(len(schema.candidate_features))]
                columns += [lists(cands, n, f"l{j}") for j in range(len(schema.tasks))]
                if o.candidate_dense_columns:  # after the labels, as fmt.arrow_schema has it
                    columns.append(_candidate_numeric(cands, n, len(o.candidate_dense_columns)))
                columns += [block.column(f"s{j}") for j in range(len(schema.sparse_features))]
                if o.dense_columns:
                    flat = np.stack([block.column(f"d{j}").to_numpy()
                                     for j in range(len(o.dense_columns))], axis=1)
                    columns.append(pa.FixedSizeListArray.from_arrays(
                        pa.array(flat.reshape(-1), pa.float32()), len(o.dense_columns)))
                if on_block is not None:
                    on_block(self)
                yield pa.Table.from_arrays([_array(c) for c in columns],
                                           schema=target).cast(target)
        finally:
            for stream in streams:
                stream.close()

    def _sql_on(self, cursor: Any, query: str) -> Any:
        previous, self.con = self.con, cursor
        try:
            return self._sql(query)
        finally:
            self.con = previous

    def write(self, writer: Any, where: str, row_group_rows: int) -> None:
        """Stream every split's requests into ``writer``, checked block by block."""
        from gem_data.arrow_io import table_to_batch

        self._histories()
        for split in ("train", "eval"):
            for table in self.tables(split, row_group_rows):
                table_to_batch(table, self.schema).validate(self.schema,
                                                            where=f"{where} ({split})")
                writer.write(split, table)

    def temporary_files(self) -> list[tuple[str, int]]:
        """DuckDB's temporary files now (path, bytes): what it spilled and still holds."""
        return [(str(path), int(size)) for path, size in self._sql(
            "SELECT path, size FROM duckdb_temporary_files()").fetchall()]

    def engine_info(self) -> dict[str, Any]:
        import duckdb

        limit = self._one("SELECT current_setting('memory_limit')")[0]
        threads = self._one("SELECT current_setting('threads')")[0]
        return {"name": "duckdb", "version": duckdb.__version__, "memory_limit": limit,
                "threads": int(threads)}


def _candidate_numeric(cands: Any, counts: Any, width: int) -> Any:
    """The ``candidate_numeric`` list of each request: its candidates' ``cn{j}`` values, one
    candidate after another (``counts`` candidates per request), as float32."""
    import numpy as np
    import pyarrow as pa

    flat = np.stack([cands.column(f"cn{j}").to_numpy() for j in range(width)], axis=1)
    offsets = np.zeros(counts.size + 1, dtype=np.int32)
    np.cumsum(counts * width, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets),
                                    pa.array(flat.reshape(-1).astype(np.float32), pa.float32()))


def _array(column: Any) -> Any:
    import pyarrow as pa

    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
