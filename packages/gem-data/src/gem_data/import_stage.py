"""The first stage of an engine of ``gem data import`` other than numpy: both logs read in blocks
(:mod:`gem_data.import_blocks`), every row converted and checked by the numpy path's own code
(:class:`~gem_data.import_features.Features`, :class:`~gem_data.import_log.Log`: exact 64-bit
ids, strings, side tables, missing policies, labels, times), written as typed Parquet files
for the engine to join, group and split. Only a block is in memory at a time; the side tables
too when the engine gives a ``side_store`` (:mod:`gem_data.import_duckdb_side`: each block gets
the side-table rows of its keys), else each is read once, whole. Two ``hash`` texts with one id
in different blocks are found (:class:`~gem_data.import_strings.HashedTexts`: every block's
distinct pairs are staged in buckets by id); a side table's null ids inside lists are counted
once, not once per block.

What needs the whole log is left to the engine, with what it needs to decide it: whether a key
column of text is numbers (:class:`KeyKind`: the numpy path reads a text column as integers
only when every value is one, so a block's verdict is not the column's) and the raw values of
every row. Vocabularies (``import.strings = "vocabulary"``) are built by a first pass over the
logs, before the rows are converted. A side table's key column in a log is read as numbers or
text block by block (the same as the whole column's unless one column mixes text and numbers,
or negative numbers and numbers of 2^63 and more).

Staged impressions: ``row`` (in the file, from 0), ``keep`` (no feature's ``missing = "drop"``
left it out), the user (``u_n``: the number, ``u_s``: the text), every other request key column
``i`` (``k{i}_n``, ``k{i}_s``), the time ``t``, candidate features ``c{j}`` (int64, or a list),
labels ``l{j}`` (float32), context bags ``s{j}``, dense values ``d{j}`` and candidate numeric
values ``cn{j}`` (float64). Staged events: ``row``, ``keep``, ``u_n``, ``u_s``, ``t`` and event
features ``e{j}``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import numpy as np

from gem_data.import_blocks import BLOCK_BYTES, BLOCK_ROWS, read_blocks
from gem_data.import_features import (
    Features,
    describe_counts,
    merge_counts,
    read_labels,
    vocabulary_texts,
)
from gem_data.import_log import KeyCells, Log, file_kind
from gem_data.import_options import ImportOptions, log_columns, number_columns, text_columns
from gem_data.import_requests import key_columns, key_role


@attrs.define
class KeyKind:
    """What a key column is over all its blocks: numbers when every block read numbers and no
    two blocks needed int64 (a negative number) and uint64 (one of 2^63 or more) apiece, as the
    numpy path reading the whole column would (:meth:`Log.key_column`)."""

    from_text: bool = False
    text: bool = False
    signed: bool = False
    unsigned: bool = False

    def add(self, key: KeyCells) -> None:
        self.from_text |= key.from_text
        self.text |= key.numbers is None
        self.signed |= key.signed
        self.unsigned |= key.unsigned

    @property
    def numbers(self) -> bool:
        return not self.text and not (self.signed and self.unsigned)


@attrs.define
class Staged:
    """The staged logs and what the stage learnt of them."""

    impressions: Path
    events: Path
    imp_log: Log
    """The impression log, without rows: names files and rows in errors."""
    ev_log: Log
    key: tuple[str, ...]
    """The request key's columns (:func:`gem_data.import_requests.key_columns`)."""
    kinds: dict[str, KeyKind]
    """Per staged key column (``u`` of ``impressions`` / ``events``, ``k{i}``), its kind."""
    rows: dict[str, int]
    kept: dict[str, int]
    counts: dict[str, dict[str, Any]]
    vocabularies: dict[str, Any]


def _list(offsets: np.ndarray | None, values: np.ndarray) -> Any:
    import pyarrow as pa

    if offsets is None:
        return pa.array(values, pa.int64())
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values,
                                                                                pa.int64()))


def _key_arrays(key: KeyCells) -> tuple[Any, Any]:
    import pyarrow as pa

    numbers = pa.nulls(key.missing.size, pa.int64()) if key.numbers is None \
        else pa.array(key.numbers, pa.int64())
    texts = pa.nulls(key.missing.size, pa.string()) if key.texts is None \
        else pa.array(key.texts, pa.string())
    return numbers, texts


def staged_schema(schema: Any, options: ImportOptions, log: str, key_count: int) -> Any:
    """The arrow schema of a staged log (see the module doc)."""
    import pyarrow as pa

    ids = pa.list_(pa.int64())
    fields = [("row", pa.int64()), ("keep", pa.bool_()), ("u_n", pa.int64()),
              ("u_s", pa.string())]
    if log == "events":
        fields.append(("t", pa.int64()))
        fields += [(f"e{j}", ids if f.multi_valued else pa.int64())
                   for j, f in enumerate(schema.event_features)]
        return pa.schema(fields)
    for i in range(key_count):
        fields += [(f"k{i}_n", pa.int64()), (f"k{i}_s", pa.string())]
    fields.append(("t", pa.int64()))
    fields += [(f"c{j}", ids if f.multi_valued else pa.int64())
               for j, f in enumerate(schema.candidate_features)]
    fields += [(f"l{j}", pa.float32()) for j in range(len(schema.tasks))]
    fields += [(f"s{j}", ids) for j in range(len(schema.sparse_features))]
    fields += [(f"d{j}", pa.float64()) for j in range(len(options.dense_columns))]
    fields += [(f"cn{j}", pa.float64()) for j in range(len(options.candidate_dense_columns))]
    return pa.schema(fields)


class _Stager:
    """One staging of both logs; what it learns block by block (key kinds, row counts, missing
    value counts) accumulates here until :meth:`run` returns it as :class:`Staged`."""

    def __init__(self, impressions: Path, events: Path, schema: Any, options: ImportOptions,
                 directory: Path, block_rows: int, block_bytes: int,
                 side_store: Any = None) -> None:
        from gem_data.import_options import feature_keys
        from gem_data.import_strings import HashedTexts

        self.paths = {"impressions": impressions, "events": events}
        self.schema, self.options, self.directory = schema, options, directory
        self.block_rows, self.block_bytes = block_rows, block_bytes
        self.side_tables: dict[int, Any] = {}
        """Without a ``side_store``: the side tables, each read whole once."""
        self.side_store = side_store
        self.side_keys = {key for join in options.join for key in join.features}
        self.feature_keys = feature_keys(schema, options)
        self.hashed = HashedTexts(directory / "hashed")
        self.counts: dict[str, dict[str, Any]] = {}
        self.kinds: dict[str, KeyKind] = {}
        self.rows = {"impressions": 0, "events": 0}
        self.kept = {"impressions": 0, "events": 0}
        self.key: tuple[str, ...] = ()
        self.found_vocabularies: dict[str, Any] | None = None
        """The vocabularies as the last block's features held them (None: no block yet)."""

    def order(self, key: str) -> tuple[int, int]:
        """Where the numpy path checks the ``hash`` feature ``key``: by table, then feature."""
        table = self.feature_keys[key][1].table
        return list(self.options.strings).index(table), list(self.feature_keys).index(key)

    def on_hashed(self, key: str, where: str, texts: Any, ids: np.ndarray) -> None:
        """A block's texts of a ``hash`` feature, for :meth:`HashedTexts.check`. A side
        table's are not a block's: read whole, every block's are the whole column's, checked
        by ``string_ids``; looked up by a store, the store checked them all."""
        if key not in self.side_keys:
            self.hashed.add(where, self.order(key), texts, ids)

    def block_side_tables(self, log: str, block: Log, rows: bool = True) -> dict[int, Any]:
        """The side tables ``block`` of ``log`` joins (a store's rows for its keys, or the
        whole tables read once)."""
        if self.side_store is None:
            return self.side_tables
        return self.side_store.tables(self, log, block, rows)

    def blocks(self, log: str) -> Any:
        o = self.options
        what = "impression log" if log == "impressions" else "event log"
        return read_blocks(self.paths[log], what, o.delimiter,
                           text_columns(self.schema, o, log),
                           wanted=log_columns(self.schema, o, log),
                           floats=number_columns(self.schema, o, log),
                           times=[o.timestamp_column], block_rows=self.block_rows,
                           block_bytes=self.block_bytes)

    def vocabularies(self) -> dict[str, Any]:
        """A first pass: the vocabulary of every ``vocabulary`` table over both logs."""
        import pyarrow as pa
        import pyarrow.compute as pc

        from gem_data.import_strings import Vocabulary

        seen: dict[str, Any] = {}
        for log in ("impressions", "events"):
            for block in self.blocks(log):
                logs = {"impressions": None, "events": None, log: block}
                side = self.block_side_tables(log, block, rows=False)
                for table, arrays in vocabulary_texts(self.schema, self.options, logs,
                                                      side).items():
                    merged = [a.cast(pa.string()) for a in arrays]
                    if table in seen:
                        merged.append(seen[table])
                    if merged:
                        distinct = pc.unique(pa.chunked_array(merged, pa.string()))
                        seen[table] = distinct.combine_chunks() \
                            if isinstance(distinct, pa.ChunkedArray) else distinct
        store = self.side_store.texts if self.side_store is not None else {}
        for table, texts in store.items():  # the side tables' texts (store: not in ``side``)
            seen[table] = pc.unique(pa.chunked_array(
                [texts] + ([seen[table]] if table in seen else []), pa.string()))
        return {table: Vocabulary.build(table, [seen[table]] if table in seen else [])
                for table, policy in self.options.strings.items() if policy == "vocabulary"}

    def run(self, vocabularies: dict[str, Any] | None, users_as_text: bool | None) -> Staged:
        import pyarrow as pa

        from gem_core.errors import GemDataError

        o, schema = self.options, self.schema
        for path in self.paths.values():  # both files there before either is read
            file_kind(path)
        if vocabularies is None and "vocabulary" in o.strings.values():
            vocabularies = self.vocabularies()
        paths = {log: self.directory / f"{log}.parquet" for log in self.rows}
        for log in ("impressions", "events"):
            self.stage(log, paths[log], vocabularies)
            if log == "impressions" and not self.rows[log]:
                raise GemDataError(f"{self.paths[log]}: the impression log has no rows")
        self.hashed.check()  # two texts with one id in different blocks
        if not self.kept["impressions"]:
            raise GemDataError(f"{self.paths['impressions']}: every impression was dropped for a "
                               f"missing value (missing = \"drop\"): "
                               f"{'; '.join(describe_counts(self.counts))}")
        # A data set of text user ids appended to reads both logs' users as text (the engine
        # checks that they are: import_append.users_as_text), so their kinds may differ here.
        kinds = self.kinds
        if self.rows["events"] and "u_events" in kinds and not users_as_text and \
                kinds["u_events"].numbers != kinds["u_impressions"].numbers:
            raise GemDataError(f"column {o.user_column!r}: the user ids of "
                               f"{self.paths['impressions']} and {self.paths['events']} have "
                               "different types (one integers, one text)")
        pa.default_memory_pool().release_unused()  # the blocks' memory, back to the system
        found = self.found_vocabularies
        return Staged(impressions=paths["impressions"], events=paths["events"],
                      imp_log=_empty_log(self.paths["impressions"], "impression log", o),
                      ev_log=_empty_log(self.paths["events"], "event log", o), key=self.key,
                      kinds=kinds, rows=self.rows, kept=self.kept,
                      counts=_ordered(self.counts, schema, o),
                      vocabularies=found if found is not None else (vocabularies or {}))

    def stage(self, log: str, path: Path, vocabularies: dict[str, Any] | None) -> None:
        """Convert and check ``log`` block by block into the Parquet file ``path``."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        o, schema = self.options, self.schema
        writer = None
        for block in self.blocks(log):
            if log == "impressions" and not self.key:
                self.key = key_columns(o, block)
            others = [c for c in self.key if c not in (o.user_column, o.timestamp_column)]
            if writer is None:
                writer = pq.ParquetWriter(path, staged_schema(schema, o, log, len(others)))
            logs = {"impressions": None, "events": None, log: block}
            features = Features(schema, o, logs["impressions"], logs["events"], vocabularies,
                                self.block_side_tables(log, block), on_hashed=self.on_hashed)
            self.found_vocabularies = features.vocabularies
            merge_counts(self.counts, features.counts)
            for key in self.side_keys & features.counts.keys():
                # A whole side table's null ids are in every block's counts: counted once.
                if "null_ids_removed" in features.counts[key]:
                    self.counts[key]["null_ids_removed"] = \
                        features.counts[key]["null_ids_removed"]
            columns = self.block_columns(log, block, features, others)
            writer.write_table(pa.Table.from_arrays(columns, schema=writer.schema))
            self.rows[log] += block.table.num_rows
            self.kept[log] += int(features.keep[log].sum())
        if writer is None:  # no rows: an empty staged log
            pq.write_table(staged_schema(schema, o, log, 0).empty_table(), path)
        else:
            writer.close()

    def block_columns(self, log: str, block: Log, features: Features,
                      others: list[str]) -> list[Any]:
        """A block's staged columns, in :func:`staged_schema`'s order; notes the kinds of its
        key columns."""
        import pyarrow as pa

        o, schema = self.options, self.schema
        user = block.key_column(o.user_column, "user")
        self.kinds.setdefault(f"u_{log}", KeyKind()).add(user)
        n = block.table.num_rows
        columns = [pa.array(np.arange(block.first_row, block.first_row + n)),
                   pa.array(features.keep[log]), *_key_arrays(user)]
        if log == "impressions":
            for i, name in enumerate(others):
                cells = block.key_column(name, key_role(name, o))
                self.kinds.setdefault(f"k{i}", KeyKind()).add(cells)
                columns += _key_arrays(cells)
        what = "request time" if log == "impressions" else "event time"
        times = block.times(o.timestamp_column, what)
        block.check_floor(times, o.timestamp_column, what, o.time_floor)
        columns.append(pa.array(times, pa.int64()))
        if log == "events":
            return columns + [_list(*features.ids[f"event.{f.name}"])
                              for f in schema.event_features]
        columns += [_list(*features.ids[f"candidate.{f.name}"])
                    for f in schema.candidate_features]
        columns += [pa.array(v, pa.float32()) for v in read_labels(block, schema, o).values()]
        columns += [_list(*features.ids[f"sparse.{f.name}"]) for f in schema.sparse_features]
        for numbers in (features.dense, features.candidate_numeric):
            if numbers is not None:
                columns += [pa.array(numbers[:, j], pa.float64()) for j in range(numbers.shape[1])]
        return columns


def _empty_log(path: Path, what: str, options: ImportOptions) -> Log:
    import pyarrow as pa

    return Log(path, what, options.delimiter, table=pa.table({}), columns=[])


def _ordered(counts: dict[str, dict[str, Any]], schema: Any, options: ImportOptions
             ) -> dict[str, dict[str, Any]]:
    from gem_data.import_options import feature_keys

    order = list(feature_keys(schema, options))
    return {key: counts[key] for key in sorted(counts, key=order.index)}


def stage_logs(impressions: Path, events: Path, schema: Any, options: ImportOptions,
               directory: Path, *, vocabularies: dict[str, Any] | None = None,
               block_rows: int = BLOCK_ROWS, block_bytes: int = BLOCK_BYTES,
               users_as_text: bool | None = None, side_store: Any = None) -> Staged:
    """Stage both logs into ``directory`` (see the module doc); ``vocabularies``: those of
    ``--vocabulary-from`` (else built from the logs); ``users_as_text``: how the data set a
    window is appended to reads its user ids (None: not appending); ``side_store``: what
    holds the side tables and looks up their rows for each block
    (:class:`gem_data.import_duckdb_side.SideStore`; None: each is read whole into memory,
    once). Raises GemDataError naming file, row and column of the first bad value found."""
    return _Stager(Path(impressions), Path(events), schema, options, Path(directory),
                   block_rows, block_bytes, side_store).run(vocabularies, users_as_text)


def import_report(staged: Staged, split: dict[str, Any], *, requests: int, all_requests: int,
                  user_numbers: bool) -> dict[str, Any]:
    """The manifest's ``info`` of an import an engine ran over ``staged`` logs: the ``split``
    summary, the requests kept (``requests`` of ``all_requests`` keys) and dropped, and the
    per-feature counts and vocabularies staging gathered (the same on every engine)."""
    return {
        "split": split,
        "requests": {"key": list(staged.key), "requests": requests,
                     "dropped_impressions": staged.rows["impressions"] - staged.kept["impressions"],
                     "dropped_events": staged.rows["events"] - staged.kept["events"],
                     "dropped_requests": all_requests - requests,
                     "user_ids": "integers" if user_numbers else "text"},
        "features": staged.counts,
        "vocabularies": staged.vocabularies,
    }
