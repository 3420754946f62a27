"""A DuckDB query's result read as blocks of exactly the rows asked for, with DuckDB's errors
(running out of memory under ``--memory-limit`` above all) as one-line GemDataError: what the
DuckDB engine (:mod:`gem_data.import_duckdb`, :mod:`gem_data.import_duckdb_windows`) streams
requests and history tails with."""

from __future__ import annotations

from typing import Any


def quote_identifier(name: str) -> str:
    """``name`` as a DuckDB identifier (in double quotes, any inside doubled)."""
    return '"' + name.replace('"', '""') + '"'


class ResultRows:
    """A DuckDB result read as blocks of exactly the rows asked for."""

    def __init__(self, cursor: Any, reader: Any, memory_limit: str | None) -> None:
        self.cursor, self.reader, self.memory_limit = cursor, reader, memory_limit
        self.pending: list[Any] = []
        self.count = 0
        self.done = False

    def take(self, rows: int) -> Any:
        """The next ``rows`` rows as a table (fewer at the end; None when none are left)."""
        import pyarrow as pa

        while self.count < rows and not self.done:
            batch = self._next()
            if batch is None:
                self.done = True
            elif batch.num_rows:
                self.pending.append(batch)
                self.count += batch.num_rows
        if not self.count or not rows:
            return None
        table = pa.Table.from_batches(self.pending)
        taken, rest = table.slice(0, rows), table.slice(rows)
        self.pending, self.count = rest.to_batches(), rest.num_rows
        return taken

    def _next(self) -> Any:
        from gem_core.errors import GemDataError

        try:
            return self.reader.read_next_batch()
        except StopIteration:
            return None
        except Exception as error:  # DuckDB's own, or wrapped by pyarrow's reader
            if "memory" in str(error).lower():
                raise GemDataError(f"DuckDB ran out of memory under --memory-limit "
                                   f"{self.memory_limit or '(not given)'} while returning "
                                   f"the requests: raise --memory-limit ({error})") from None
            raise GemDataError(f"DuckDB: {error}") from None

    def close(self) -> None:
        self.reader.close()
        self.cursor.close()
