"""Side tables (``[[import.join]]``) on the DuckDB engine, never whole in Python's memory: what
:func:`gem_data.import_stage.stage_logs` joins into each block of a log when given a
:class:`SideStore`.

A side table is staged when the first block of the log it joins is (so a side table of an
empty log is not read, as on the numpy path): read in blocks (:mod:`gem_data.import_blocks`),
its rows go into a DuckDB table (spilling as DuckDB does) with their row in the file and their
key as a number and as text; DuckDB then finds a repeated key (the numpy path's error: the
first repeated key in key order, its first two rows, how many rows repeat a key); a second
read converts and checks every feature column by the numpy path's code
(:meth:`~gem_data.import_log.Log.cells`: missing values, lists, ids outside a ``dense``
table), collects ``vocabulary`` texts, checks ``hash`` texts for two with one id across blocks
(:class:`~gem_data.import_strings.HashedTexts`) and counts null ids inside lists once, over the
whole table, as the numpy path does. Whether the keys are numbers or text is decided over the
whole table (:class:`~gem_data.import_stage.KeyKind`).

Then, for each block of the log, DuckDB returns the rows whose keys the block holds, in file
order, which :class:`~gem_data.import_features.Features` receives as a side table of those
rows (:class:`BlockSideTable`) and joins as it joins a whole one: a key not among them is not
in the side table, and follows the feature's ``missing`` policy with the same counts and
errors. A side table without rows is read whole (it is empty). The numpy engine, the
in-memory reference, and an engine staging without a store read every side table whole.

Each block's lookup scans the side table's DuckDB table (a hash join against the block's
keys): the time grows with blocks times side-table rows, the memory does not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from gem_data.import_blocks import read_blocks
from gem_data.import_features import SideTable, missing_hint, repeated_key
from gem_data.import_log import Cells, Log
from gem_data.import_options import NUMERIC_KINDS

_BLOCK = "gem_side_block"
"""The name a block of rows or keys is registered under in DuckDB while it is read."""


class _RowsLog(Log):
    """Some rows of a side table: errors name each by its row in the file."""

    def __init__(self, path: Path, delimiter: str, table: Any, rows: np.ndarray,
                 columns: list[str]) -> None:
        super().__init__(path, "side table", delimiter, table=table, columns=columns)
        self.rows = rows

    def row_name(self, row: int) -> str:
        return super().row_name(int(self.rows[row]))


class BlockSideTable(SideTable):
    """The rows of a side table whose keys a block of a log holds, joined as the whole table
    is: keys compared as the whole table's are (numbers or text), its type checked against
    the log's key column as the whole table's is, its null ids counted by the store, not
    here (once for the whole table, not once per block)."""

    def __init__(self, join: Any, log: _RowsLog, keys: np.ndarray, key_count: int,
                 key_text: bool) -> None:
        # SideTable's own __init__ reads the file; these are the attributes it would set.
        self.join, self.log, self._memo = join, log, {}
        order = np.argsort(keys, kind="stable")
        self.sorted_keys, self.sorted_rows = keys[order], order
        self.key_count, self.key_text = key_count, key_text

    def cells(self, column: str, role: str, **options: Any) -> Cells:
        cells = super().cells(column, role, **options)
        cells.null_ids = 0
        return cells


class _Staged:
    """One side table in DuckDB: its table, columns and what its keys are."""

    def __init__(self, table: str, names: list[str], columns: list[str], rows: int,
                 numbers: bool) -> None:
        self.table, self.names, self.columns = table, names, columns
        self.rows, self.numbers = rows, numbers
        self.empty: Any = None  # its columns without rows (as DuckDB returns them)


class SideStore:
    """The side tables of one DuckDB import (``run``: its
    :class:`~gem_data.import_duckdb.DuckDBImport`, whose connection holds them)."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self.staged: dict[int, _Staged | SideTable] = {}
        self.texts: dict[str, Any] = {}
        """Per ``vocabulary`` table, the distinct texts of the side tables staged."""

    def tables(self, stager: Any, log: str, block: Log, rows: bool = True) -> dict[int, Any]:
        """The side tables of the joins of ``log`` for ``block`` (by their index in
        ``[[import.join]]``), staging them first if this is the log's first block; without
        ``rows`` none of their rows (a pass that needs only their staging)."""
        result = {}
        for index, join in enumerate(stager.options.join):
            if join.log != log:
                continue
            if index not in self.staged:
                self.staged[index] = self._stage(stager, index, join)
            staged = self.staged[index]
            result[index] = staged if isinstance(staged, SideTable) else \
                self._rows(staged, join, stager.options.delimiter, block, rows)
        return result

    # -- staging ---------------------------------------------------------------------------------

    def _blocks(self, stager: Any, join: Any) -> Any:
        o = stager.options
        keys = stager.feature_keys
        ids = [c for k, c in join.features.items() if keys[k][0] not in NUMERIC_KINDS]
        numbers = [c for k, c in join.features.items() if keys[k][0] in NUMERIC_KINDS]
        return read_blocks(Path(join.file), "side table", o.delimiter, [join.key] + ids,
                           wanted=[join.key, *join.features.values()], floats=numbers,
                           block_rows=stager.block_rows, block_bytes=stager.block_bytes)

    def _stage(self, stager: Any, index: int, join: Any) -> _Staged | SideTable:
        """Stage the side table of ``join`` into DuckDB and check it (see the module doc)."""
        import pyarrow as pa

        from gem_data.import_stage import KeyKind

        kind, table, names, columns, rows = KeyKind(), f"gem_side{index}", [], [], 0
        for block in self._blocks(stager, join):
            key = block.key_column(join.key, "side-table key")
            kind.add(key)
            names, columns = block.table.column_names, block.columns
            n = block.table.num_rows
            numbers = pa.nulls(n, pa.int64()) if key.numbers is None else \
                pa.array(key.numbers, pa.int64())
            texts = pa.nulls(n, pa.string()) if key.texts is None else \
                pa.array(key.texts, pa.string())
            arrays = [pa.array(np.arange(block.first_row, block.first_row + n)), numbers,
                      texts, *block.table.columns]
            into = "INSERT INTO {t} SELECT * FROM {b}" if rows else \
                "CREATE TABLE {t} AS SELECT * FROM {b}"
            self._with(pa.Table.from_arrays(arrays, names=["gem_row", "gem_key_n", "gem_key_s"]
                                            + [f"c{i}" for i in range(len(names))]),
                       into.format(t=table, b=_BLOCK))
            rows += n
        if not rows:  # no rows: nothing to hold out of memory, read as the numpy path reads it
            keys = stager.feature_keys
            return SideTable(join, stager.options.delimiter,
                             [c for k, c in join.features.items()
                              if keys[k][0] not in NUMERIC_KINDS])
        staged = _Staged(table, list(names), list(columns), rows, kind.numbers)
        self._refuse_repeated_keys(staged, join, stager.options.delimiter)
        self._check_columns(stager, join)
        return staged

    def _with(self, table: Any, query: str) -> Any:
        """Run ``query`` with ``table`` registered as :data:`_BLOCK`; its result as an arrow
        table (read before unregistering, which ends the result)."""
        self.run.con.register(_BLOCK, table)
        try:
            return self.run._sql(query).to_arrow_table()
        finally:
            self.run.con.unregister(_BLOCK)

    def _refuse_repeated_keys(self, staged: _Staged, join: Any, delimiter: str) -> None:
        from gem_core.errors import GemDataError

        key = "gem_key_n" if staged.numbers else "gem_key_s"
        found = self.run._one(f"WITH d AS (SELECT {key} AS k, count(*) AS c FROM {staged.table} "
                              "GROUP BY k HAVING count(*) > 1) SELECT (SELECT sum(c - 1) FROM "
                              "d), (SELECT k FROM d ORDER BY k LIMIT 1)")
        if found[0]:
            first, second = (r for (r,) in self.run._sql(
                f"SELECT gem_row FROM {staged.table} WHERE {key} = ? ORDER BY gem_row LIMIT 2",
                [found[1]]).fetchall())
            log = Log(Path(join.file), "side table", delimiter, table=_no_rows(), columns=[])
            raise GemDataError(repeated_key(log, join.key, found[1], first, second,
                                            int(found[0])))

    def _check_columns(self, stager: Any, join: Any) -> None:
        """Read every feature column of the side table as the numpy path reads it (its
        errors), count null ids, collect vocabulary texts, check hashed texts."""
        import pyarrow as pa
        import pyarrow.compute as pc

        from gem_data.import_features import _check_dense_ids, _present_texts
        from gem_data.import_strings import string_ids

        o, schema = stager.options, stager.schema
        null_ids: dict[str, int] = {}
        for block in self._blocks(stager, join):
            for key, column in join.features.items():
                kind, feature = stager.feature_keys[key]
                allow = o.feature(key).missing != "error"
                if kind in NUMERIC_KINDS:  # "dense feature", "candidate dense feature"
                    block.float_cells(column, f"{kind.replace('_', ' ')} feature",
                                      allow_missing=allow, hint=missing_hint(key))
                    continue
                policy = o.strings.get(feature.table)
                role = f"{'context' if kind == 'sparse' else kind} feature {feature.name!r}"
                cells = block.cells(column, role, multi=kind == "sparse" or feature.multi_valued,
                                    text=policy is not None, allow_missing=allow,
                                    hint=missing_hint(key))
                null_ids[key] = null_ids.get(key, 0) + cells.null_ids
                if policy == "vocabulary":
                    texts = [_present_texts(cells).cast(pa.string())]
                    texts += [self.texts[feature.table]] if feature.table in self.texts else []
                    self.texts[feature.table] = pc.unique(pa.chunked_array(texts, pa.string()))
                elif policy == "hash":
                    prefix = f"{block.path}, column {column!r}: "
                    stager.hashed.add(prefix, stager.order(key), cells.values,
                                      string_ids(cells.values, where=prefix))
                else:
                    _check_dense_ids(block, column, cells, schema.table(feature.table))
        stager.hashed.check()
        for key, count in null_ids.items():
            if count:  # before the blocks' counts of the key: the numpy path's order of fields
                entry = stager.counts.setdefault(key, {"policy": o.feature(key).missing,
                                                       "missing": 0})
                entry["null_ids_removed"] = entry.get("null_ids_removed", 0) + count

    # -- looking up ------------------------------------------------------------------------------

    def _rows(self, staged: _Staged, join: Any, delimiter: str, block: Log,
              rows: bool) -> BlockSideTable:
        """The side table of the rows whose keys ``block`` holds (none without ``rows``, or
        when the block's keys are not what the table's are: :meth:`SideTable.rows_for` then
        refuses the two types)."""
        import pyarrow as pa

        path = Path(join.file)
        keys = block.key_column(join.joined_column, f"key of side table {path.name}",
                                allow_missing=True)
        numbers = keys.numbers is not None
        wanted = keys.values[~keys.missing]
        if rows and wanted.size and numbers == staged.numbers:
            found = self._with(pa.table({"k": pa.array(np.unique(wanted), pa.int64() if numbers
                                                        else pa.string())}),
                               f"SELECT * FROM {staged.table} WHERE gem_key_"
                               f"{'n' if numbers else 's'} IN (SELECT k FROM {_BLOCK}) "
                               "ORDER BY gem_row")
        else:
            if staged.empty is None:
                staged.empty = self.run._sql(f"SELECT * FROM {staged.table} LIMIT 0"
                                             ).to_arrow_table()
            found = staged.empty
        key = found.column("gem_key_n" if staged.numbers else "gem_key_s")
        key = key.to_numpy() if staged.numbers else \
            key.to_numpy(zero_copy_only=False).astype(str)
        table = pa.Table.from_arrays(found.columns[3:], names=staged.names)
        log = _RowsLog(path, delimiter, table, found.column("gem_row").to_numpy(),
                       staged.columns)
        return BlockSideTable(join, log, key, staged.rows, not staged.numbers)


def _no_rows() -> Any:
    import pyarrow as pa

    return pa.table({})
