"""The features of ``gem data import``, row by row of each log, before requests are formed: each
feature's ids (or dense values) from its own column or from a side table (``[[import.join]]``),
string categories mapped to ids (``[import.strings]``), missing values treated by the feature's
policy (``[import.features]``), every count kept for the import's report.

Order, so that every error names the file it is about: a feature's cells are read from their
source (the log, or the side table: a bad id there names the side table's row), text becomes
ids (a vocabulary is built from every source of its table first), ids are checked against a
``dense`` table, then side-table cells are gathered onto the log's rows by key (a key not in
the side table is a missing value), and last the missing policy fills or drops.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

from gem_data.import_log import Cells, Log
from gem_data.import_options import NUMERIC_KINDS, ImportOptions, JoinOptions, feature_keys
from gem_data.import_strings import MISSING_ID, Vocabulary, string_ids

Ids = tuple  # (offsets or None, int64 values)


def missing_hint(key: str) -> str:
    return f'; to allow it set [import.features."{key}"] missing = "default" or "drop"'


def repeated_key(log: Log, column: str, key: Any, first: int, second: int, count: int) -> str:
    """The error of a side table whose ``key`` is on rows ``first`` and ``second`` (the first
    repeated key in key order; ``count`` rows repeat a key)."""
    return (f"{log.path}, {log.row_name(second)}, column {column!r}: key {key!r} appears again "
            f"(first on {log.row_name(first)}; {count} repeated keys); a side table has one row "
            "per key")


class SideTable:
    """One ``[[import.join]]`` side table: its rows by key."""

    def __init__(self, join: JoinOptions, delimiter: str, id_columns: list[str]) -> None:
        from gem_core.errors import GemDataError

        self.join = join
        self._memo: dict[tuple, Any] = {}
        self.log = Log(Path(join.file), "side table", delimiter, [join.key] + id_columns)
        keys = self.log.keys(join.key, "side-table key")
        order = np.argsort(keys, kind="stable")
        self.sorted_keys, self.sorted_rows = keys[order], order
        # What the whole table's keys are: a side table of some of its rows has its own.
        self.key_count, self.key_text = keys.size, keys.dtype.kind == "U"
        same = np.flatnonzero(self.sorted_keys[1:] == self.sorted_keys[:-1])
        if same.size:
            first, second = int(order[same[0]]), int(order[same[0] + 1])
            raise GemDataError(repeated_key(self.log, join.key, keys[second].item(), first,
                                            second, same.size))

    def cells(self, column: str, role: str, **options: Any) -> Cells:
        """:meth:`Log.cells` of a side-table column, read once (a log read in blocks joins it
        block by block); a fresh :class:`Cells` each time, as callers replace its values."""
        key = ("cells", column, role, tuple(sorted(options.items())))
        if key not in self._memo:
            self._memo[key] = self.log.cells(column, role, **options)
        c = self._memo[key]
        return Cells(c.offsets, c.values, c.missing, c.null_ids, c.text)

    def float_cells(self, column: str, role: str, **options: Any
                    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`Log.float_cells` of a side-table column, read once."""
        key = ("floats", column, role, tuple(sorted(options.items())))
        if key not in self._memo:
            self._memo[key] = self.log.float_cells(column, role, **options)
        return self._memo[key]

    def rows_for(self, log: Log) -> tuple[np.ndarray, np.ndarray]:
        """Per row of ``log``: its side-table row (-1: none) and whether its key was null."""
        from gem_core.errors import GemDataError

        name = self.join.joined_column
        keys, null = log.key_cells(name, f"key of side table {self.log.path.name}",
                                   allow_missing=True)
        if keys.size and self.key_count and (keys.dtype.kind == "U") != self.key_text:
            raise GemDataError(f"column {name!r} of {log.path} and column {self.join.key!r} of "
                               f"{self.log.path} have different types (one integers, one text); "
                               "a key must be written the same way in both")
        if not self.sorted_keys.size:
            return np.full(keys.size, -1, dtype=np.int64), null
        at = np.minimum(np.searchsorted(self.sorted_keys, keys), self.sorted_keys.size - 1)
        found = (self.sorted_keys[at] == keys) & ~null
        return np.where(found, self.sorted_rows[at], -1).astype(np.int64), null


def _gather(cells: Cells, index: np.ndarray) -> Cells:
    """``cells`` (of a side table's rows) on the rows ``index`` (-1: no row: missing)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    def take(values: Any, where: np.ndarray) -> Any:
        return pc.take(values, pa.array(where)) if cells.text else values[where]

    unmatched = index < 0
    if cells.missing.size == 0:  # an empty side table: nothing matches
        empty = pa.array([], pa.string()) if cells.text else np.zeros(0, dtype=np.int64)
        values = (pa.nulls(index.size, pa.string()) if cells.text
                  else np.zeros(index.size, dtype=np.int64)) if cells.offsets is None else empty
        offsets = None if cells.offsets is None else np.zeros(index.size + 1, dtype=np.int64)
        return Cells(offsets, values, np.ones(index.size, dtype=bool), 0, cells.text)
    safe = np.where(unmatched, 0, index)
    missing = cells.missing[safe] | unmatched
    if cells.offsets is None:
        return Cells(None, take(cells.values, safe), missing, cells.null_ids, cells.text)
    lengths = np.diff(cells.offsets)[safe]
    lengths[unmatched] = 0
    offsets = np.zeros(index.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.arange(int(offsets[-1])) + np.repeat(cells.offsets[:-1][safe] - offsets[:-1],
                                                   lengths)
    return Cells(offsets, take(cells.values, flat), missing, cells.null_ids, cells.text)


def _fill(cells: Cells, default: int) -> Ids:
    """The ids with every missing row given ``default`` (one id, for multi-valued rows)."""
    values = np.asarray(cells.values, dtype=np.int64)
    if cells.offsets is None:
        values = values.copy()
        values[cells.missing] = default
        return None, values
    if not cells.missing.any():
        return cells.offsets, values
    lengths = np.diff(cells.offsets)
    lengths[cells.missing] = 1  # missing rows have no ids: they get the default
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    filled = np.full(int(offsets[-1]), default, dtype=np.int64)
    present = np.flatnonzero(~cells.missing)
    within = np.arange(values.size) - np.repeat(cells.offsets[:-1][present],
                                                np.diff(cells.offsets)[present])
    filled[np.repeat(offsets[:-1][present], np.diff(cells.offsets)[present]) + within] = values
    return offsets, filled


def _check_dense_ids(log: Log, column: str, cells: Cells, table: Any) -> None:
    """Under the ``dense`` id policy, every id must be a row of the table: name the first
    that is not, by input row."""
    values = np.asarray(cells.values)
    if table.id_policy != "dense" or values.size == 0:
        return
    bad = (values < 0) | (values >= table.num_embeddings)
    if cells.offsets is None:
        bad &= ~cells.missing
    bad = np.flatnonzero(bad)
    if bad.size:
        row = int(bad[0]) if cells.offsets is None else \
            int(np.searchsorted(cells.offsets, bad[0], side="right") - 1)
        log.fail(row, column, f"id {int(values[bad[0]])} is outside [0, {table.num_embeddings}) "
                              f"of table {table.name!r} (id_policy dense; {bad.size} such ids); "
                              "use id_policy = \"modulo\" or \"hash\" for unbounded ids")


def read_sources(schema: Any, options: ImportOptions, logs: dict[str, Log | None],
                 side_tables: dict[int, SideTable] | None = None) -> tuple[dict, dict, dict]:
    """``(keys, sources, raw)``: every feature key (:func:`feature_keys`); per feature taken
    from a side table, ``(side table, column, side-table row of each log row, null key)``; per
    id feature of a log in ``logs`` (None: not read), ``(file, column, Cells)`` read from its
    source, text kept as text. ``side_tables``: side tables read before, by their index in
    ``[[import.join]]`` (filled here: a log read in blocks reads each once)."""
    keys = feature_keys(schema, options)
    tables = {} if side_tables is None else side_tables
    source: dict[str, tuple[SideTable, str, np.ndarray, np.ndarray]] = {}
    for index, join in enumerate(options.join):
        log = logs[join.log]
        if log is None:
            continue
        if index not in tables:
            id_columns = [c for k, c in join.features.items()
                          if keys[k][0] not in NUMERIC_KINDS]
            tables[index] = SideTable(join, options.delimiter, id_columns)
        side = tables[index]
        rows, null = side.rows_for(log)
        for key, column in join.features.items():
            source[key] = (side, column, rows, null)

    raw: dict[str, tuple[Log, str, Cells]] = {}
    for key, (kind, feature) in keys.items():
        if kind in NUMERIC_KINDS:
            continue
        log = logs[_log_of(kind)]
        if log is None:
            continue
        text = feature.table in options.strings
        multi = kind == "sparse" or feature.multi_valued
        allow = options.feature(key).missing != "error"
        role = f"{'context' if kind == 'sparse' else kind} feature {feature.name!r}"
        if key in source:
            side, column, _, _ = source[key]
            raw[key] = (side.log, column, side.cells(column, role, multi=multi, text=text,
                                                     allow_missing=allow,
                                                     hint=missing_hint(key)))
        else:
            column = options.columns.get(f"{kind}.{feature.name}", feature.name)
            raw[key] = (log, column, log.cells(column, role, multi=multi, text=text,
                                               allow_missing=allow, hint=missing_hint(key)))
    return keys, source, raw


def vocabulary_texts(schema: Any, options: ImportOptions, logs: dict[str, Log | None],
                     side_tables: dict[int, SideTable] | None = None) -> dict[str, list[Any]]:
    """Per table with ``import.strings = "vocabulary"``, the texts its features have in
    ``logs`` and their side tables (pyarrow arrays): what :class:`Features` builds the
    vocabulary from, for an engine that reads the logs in blocks and builds it first."""
    keys, _, raw = read_sources(schema, options, logs, side_tables)
    return {table: [_present_texts(raw[k][2]) for k, (kind, f) in keys.items()
                    if kind not in NUMERIC_KINDS and k in raw and f.table == table]
            for table, policy in options.strings.items() if policy == "vocabulary"}


class Features:
    """Every feature of both logs, resolved over the logs' rows (see the module doc). ``imp``
    or ``ev`` may be None (not read: a block of the other log). ``on_hashed``: called with the
    feature key, the prefix of its errors, its texts and their ids for every ``hash`` feature
    (by an engine reading in blocks, to find two texts with one id across blocks)."""

    def __init__(self, schema: Any, options: ImportOptions, imp: Log | None, ev: Log | None,
                 vocabularies: dict[str, Vocabulary] | None = None,
                 side_tables: dict[int, SideTable] | None = None,
                 on_hashed: Callable[[str, str, Any, np.ndarray], None] | None = None) -> None:
        from gem_core.errors import GemDataError

        self.schema, self.options = schema, options
        self.logs = {"impressions": imp, "events": ev}
        self.keep = {name: np.ones(0 if log is None else log.table.num_rows, dtype=bool)
                     for name, log in self.logs.items()}
        self.counts: dict[str, dict[str, Any]] = {}
        keys, source, raw = read_sources(schema, options, self.logs, side_tables)
        self.sources = source

        # Text to ids, per table: one vocabulary over every source of the table.
        self.vocabularies: dict[str, Vocabulary] = {}
        given = vocabularies or {}
        for table_name, policy in options.strings.items():
            table = schema.table(table_name)
            users = [k for k, (kind, f) in keys.items() if kind not in NUMERIC_KINDS
                     and k in raw and f.table == table_name]
            if policy == "vocabulary":
                vocabulary = given.get(table_name)
                if vocabulary is None and given:
                    raise GemDataError(f"--vocabulary-from has no vocabulary of table "
                                       f"{table_name!r} (it has: {', '.join(sorted(given))})")
                if vocabulary is None:
                    vocabulary = Vocabulary.build(table_name, [_present_texts(raw[k][2])
                                                               for k in users])
                if table.id_policy == "dense" and vocabulary.size > table.num_embeddings:
                    raise GemDataError(
                        f"table {table_name!r} has num_embeddings = {table.num_embeddings} but "
                        f"its vocabulary needs {vocabulary.size} rows ({len(vocabulary.values)} "
                        "values + the missing and out-of-vocabulary rows); raise num_embeddings")
                self.vocabularies[table_name] = vocabulary
            for key in users:
                where, column, cells = raw[key]
                if policy == "vocabulary":
                    ids, unknown = self.vocabularies[table_name].ids(cells.values)
                    if unknown.any():
                        self._count(key)["out_of_vocabulary"] = int(unknown.sum())
                else:
                    prefix = f"{where.path}, column {column!r}: "
                    ids = string_ids(cells.values, where=prefix)
                    if on_hashed is not None:  # a block of a log: collisions across blocks
                        on_hashed(key, prefix, cells.values, ids)
                cells.values, cells.text = ids, False

        # Checked ids, gathered by key, missing values treated.
        self.ids: dict[str, Ids] = {}
        for key, (where, column, cells) in raw.items():
            kind, feature = keys[key]
            _check_dense_ids(where, column, cells, schema.table(feature.table))
            if cells.null_ids:
                self._count(key)["null_ids_removed"] = cells.null_ids
            if key in source:
                cells = self._joined(key, cells)
            entry = options.feature(key)
            default = entry.default
            if default is None and options.strings.get(feature.table) == "vocabulary":
                default = MISSING_ID
            self.ids[key] = self._treat(key, cells, default if default is not None else 0)

        # Numbers per impression: the request's dense features, the candidate's numeric ones.
        self.dense = self._numbers("dense", options.dense_columns, "dense feature")
        self.candidate_numeric = self._numbers("candidate_dense", options.candidate_dense_columns,
                                               "candidate dense feature")

    def column(self, kind: str, name: str) -> str:
        return self.options.columns.get(f"{kind}.{name}", name)

    def _numbers(self, kind: str, names: tuple[str, ...], role: str) -> np.ndarray | None:
        """``(impressions, len(names))`` float64 values of the impression log's numeric
        columns ``names`` (``dense`` or ``candidate_dense``), each from its column or its side
        table, missing values treated; None without such columns (or impressions)."""
        imp = self.logs["impressions"]
        if not names or imp is None:
            return None
        columns = []
        for name in names:
            key = f"{kind}.{name}"
            allow = self.options.feature(key).missing != "error"
            if key in self.sources:
                side, column, _, _ = self.sources[key]
                values, missing = side.float_cells(column, role, allow_missing=allow,
                                                   hint=missing_hint(key))
                # _joined gathers the side table's rows onto the log's (once).
                cells = self._joined(key, Cells(None, values, missing, 0, False))
            else:
                values, missing = imp.float_cells(name, role, allow_missing=allow,
                                                  hint=missing_hint(key))
                cells = Cells(None, values, missing, 0, False)
            default = self.options.feature(key).default
            columns.append(self._treat(key, cells, float(default or 0.0), dense=True)[1])
        return np.stack(columns, axis=1)

    def _count(self, key: str) -> dict[str, Any]:
        return self.counts.setdefault(key, {"policy": self.options.feature(key).missing,
                                            "missing": 0})

    def _joined(self, key: str, cells: Cells) -> Cells:
        """Side-table ``cells`` on the rows of the log they join; a key not in the side table
        is missing, which stops the import under ``missing = "error"``."""
        side, _, rows, null = self.sources[key]
        log = self.logs[side.join.log]
        gathered = _gather(cells, rows)
        unmatched = (rows < 0) & ~null
        if unmatched.any() or null.any():
            counts = self._count(key)
            counts["not_in_side_table"] = int(unmatched.sum() + null.sum())
            if counts["policy"] == "error":
                row = int(np.flatnonzero(rows < 0)[0])
                name = side.join.joined_column
                keys = log.key_cells(name, "key", allow_missing=True)[0]
                what = "has no key" if null[row] else f"key {keys[row].item()!r} is not"
                log.fail(row, name, f"{what} in side table {side.log.path} (column "
                                    f"{side.join.key!r}), which gives feature {key} "
                                    f"({counts['not_in_side_table']} such rows)"
                                    f"{missing_hint(key)}")
        return gathered

    def _treat(self, key: str, cells: Cells, default: Any, dense: bool = False) -> Ids:
        """Apply the feature's missing policy: count, then fill or mark rows to drop."""
        log_name = "impressions" if key.split(".")[0] != "event" else "events"
        count = int(cells.missing.sum())
        policy = self.options.feature(key).missing
        if count or policy != "error":
            entry = self._count(key)
            entry["missing"] = count
            if policy == "default":
                entry["default"] = default
        if policy == "drop":
            self.keep[log_name] &= ~cells.missing
        if dense:
            values = np.asarray(cells.values, dtype=np.float64).copy()
            values[cells.missing] = default
            return None, values
        return _fill(cells, int(default))


def read_labels(imp: Log, schema: Any, options: ImportOptions) -> dict[str, np.ndarray]:
    """Per task, the label of every impression (float32), each 0 or 1."""
    labels = {}
    for task in schema.tasks:
        name = options.columns.get(f"label.{task}", task)
        values = imp.floats(name, f"label of task {task!r}")
        bad = np.flatnonzero((values != 0) & (values != 1))
        if bad.size:
            imp.fail(int(bad[0]), name, f"label {values[bad[0]]} of task {task!r} is not 0 or 1")
        labels[task] = values.astype(np.float32)
    return labels


def merge_counts(total: dict[str, dict[str, Any]], counts: dict[str, dict[str, Any]]) -> None:
    """Add the per-feature counts of one block of rows to ``total``."""
    for key, entry in counts.items():
        into = total.setdefault(key, {})
        for name, value in entry.items():
            if name in ("policy", "default"):
                into.setdefault(name, value)
            else:
                into[name] = into.get(name, 0) + value


def _log_of(kind: str) -> str:
    return "events" if kind == "event" else "impressions"


def _present_texts(cells: Cells) -> Any:
    """The texts of ``cells`` that are values (a single-valued missing row holds a null)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if cells.offsets is not None:
        return cells.values
    return pc.filter(cells.values, pa.array(~cells.missing))


def describe_counts(counts: dict[str, dict[str, Any]]) -> list[str]:
    """One line per feature whose values were not all present (for the import's output)."""
    lines = []
    for key, entry in sorted(counts.items()):
        parts = []
        if entry.get("missing"):
            what = {"default": f"given the default {entry.get('default')!r}",
                    "drop": "rows dropped", "error": "error"}[entry["policy"]]
            side = entry.get("not_in_side_table")
            side = f", {side} of them with no row in the side table" if side else ""
            parts.append(f"{entry['missing']} missing{side} ({what})")
        if entry.get("null_ids_removed"):
            parts.append(f"{entry['null_ids_removed']} null ids removed from lists")
        if entry.get("out_of_vocabulary"):
            parts.append(f"{entry['out_of_vocabulary']} out of vocabulary")
        if parts:
            lines.append(f"{key}: {'; '.join(parts)}")
    return lines
