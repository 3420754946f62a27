"""Writing a data set directory (format 2): Parquet files per split in row groups, then the
manifest. Producers hand :class:`DatasetWriter` JaggedBatch objects (or tables with the data
set's arrow schema, :func:`gem_data.format.arrow_schema`); one row is one request."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gem_core.batch import JaggedBatch
from gem_core.errors import GemDataError
from gem_core.schema import FeatureSchema
from gem_data import format as fmt
from gem_data.arrow_io import batch_to_table
from gem_data.manifest import FileEntry, Manifest, with_digests, write_manifest

SPLITS = ("train", "eval")


class DatasetWriter:
    """Appends batches to one Parquet file per split; ``close()`` writes the manifest.

    Each ``write`` becomes whole row groups of at most ``row_group_rows`` rows, so the loader's
    unit of reading, sharding and resuming is known from the manifest without opening a file.
    """

    def __init__(self, directory: str | Path, schema: FeatureSchema, *, row_group_rows: int = 16384,
                 info: dict[str, Any] | None = None) -> None:
        self.directory = Path(directory)
        self.schema = schema
        self.row_group_rows = row_group_rows
        self.info = dict(info or {})
        self.arrow_schema = fmt.arrow_schema(schema)
        self._writers: dict[str, pq.ParquetWriter] = {}
        self._entries: dict[str, dict[str, Any]] = {}
        self.directory.mkdir(parents=True, exist_ok=True)
        stale = self.directory / "manifest.json"
        if stale.exists():
            stale.unlink()  # the directory is being rewritten: it is not a data set until close()

    def write(self, split: str, data: JaggedBatch | Any) -> None:
        """Append a JaggedBatch or a table with the data set's arrow schema to ``split``."""
        if split not in SPLITS:
            raise GemDataError(f"unknown split {split!r}; splits are {', '.join(SPLITS)}")
        table = batch_to_table(data, self.schema) if isinstance(data, JaggedBatch) else data
        if not table.schema.equals(self.arrow_schema):
            raise GemDataError(f"table written to {split!r} does not have the data set's schema:\n"
                               f"{table.schema}\nexpected\n{self.arrow_schema}")
        if table.num_rows == 0:
            return
        if split not in self._writers:
            name = f"{split}-00000.parquet"
            self._writers[split] = pq.ParquetWriter(
                self.directory / name, self.arrow_schema, compression="none", use_dictionary=False,
                column_encoding=_encodings(self.arrow_schema, self.schema),
                # A CRC per page: the reader verifies it, so a flipped bit in a page of plain
                # floats is an error naming the file and row group, not a wrong value.
                write_page_checksum=True)
            self._entries[split] = {"path": name, "rows": 0, "row_groups": [], "tokens": 0,
                                    "candidates": 0}
        self._writers[split].write_table(table, row_group_size=self.row_group_rows)
        entry = self._entries[split]
        full, rest = divmod(table.num_rows, self.row_group_rows)
        entry["row_groups"] += [self.row_group_rows] * full + ([rest] if rest else [])
        entry["rows"] += table.num_rows
        lengths = pc.list_value_length(table.column(fmt.HISTORY_TIMESTAMP))
        entry["tokens"] += int(pc.sum(lengths).as_py() or 0)
        counts = pc.list_value_length(table.column(fmt.label_column(self.schema.tasks[0])))
        entry["candidates"] += int(pc.sum(counts).as_py() or 0)

    def close(self) -> Manifest:
        for writer in self._writers.values():
            writer.close()
        manifest = Manifest(
            schema=self.schema,
            splits={s: (FileEntry(**e),) for s, e in self._entries.items()},
            info=self.info,
        )
        if not manifest.splits.get("train"):
            raise GemDataError(f"no training rows were written to {self.directory}")
        self._check_row_groups(manifest)
        manifest = with_digests(self.directory, manifest)
        write_manifest(self.directory, manifest)
        return manifest

    def _check_row_groups(self, manifest: Manifest) -> None:
        # The manifest's row-group sizes are what the loader shards and resumes by: make sure the
        # writer really produced them rather than trusting our arithmetic.
        for files in manifest.splits.values():
            for entry in files:
                meta = pq.ParquetFile(self.directory / entry.path).metadata
                actual = tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
                if actual != entry.row_groups:
                    raise GemDataError(f"{entry.path}: wrote row groups {actual[:8]}..., expected "
                                       f"{entry.row_groups[:8]}...")


@contextlib.contextmanager
def staged_directory(out: str | Path) -> Iterator[Path]:
    """A fresh staging directory beside ``out`` to write a whole data set into: when the block
    ends normally it takes the place of ``out`` (a rename; an older data set there is replaced),
    when it raises (or is interrupted) it is removed, so ``out`` is never left half written.
    ``out`` must be absent, empty, or a data set (it has a manifest): anything else is refused
    before anything is written."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise GemDataError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / "manifest.json").is_file():
        raise GemDataError(f"{out} exists and is not a GEM data set (no manifest.json): choose a "
                           "new directory or empty this one (a data set there is replaced)")
    out = out.resolve()  # a symbolic link: write beside (and replace) what it points to
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        old = out.parent / f".{out.name}.replaced-{os.getpid()}"
        replacing = out.is_dir()
        if replacing:
            out.rename(old)
        try:
            staging.rename(out)
        except BaseException:  # the rename failed or was interrupted: put the old set back
            if replacing:
                old.rename(out)  # the previous data set stays as it was
            raise
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:  # a failed or interrupted import: no partial files, re-raise as is
        shutil.rmtree(staging, ignore_errors=True)
        raise


def write_file(path: Path, table: Any, schema: FeatureSchema, *, row_group_rows: int) -> FileEntry:
    """Write ``table`` (with ``schema``'s arrow schema) as the single Parquet file ``path``, as
    :class:`DatasetWriter` writes (encodings, page checksums), atomically: under a temporary name
    then renamed, so the file is whole or absent (a resumable producer skips the files that
    exist). Returns its manifest entry, without size and digest."""
    expected = fmt.arrow_schema(schema)
    if not table.schema.equals(expected):
        raise GemDataError(f"{path}: table does not have the data set's schema:\n{table.schema}"
                           f"\nexpected\n{expected}")
    partial = path.with_name(path.name + ".partial")
    with pq.ParquetWriter(partial, expected, compression="none", use_dictionary=False,
                          column_encoding=_encodings(expected, schema),
                          write_page_checksum=True) as writer:
        writer.write_table(table, row_group_size=row_group_rows)
    partial.replace(path)
    return file_entry(path, schema)


def file_entry(path: Path, schema: FeatureSchema) -> FileEntry:
    """The manifest entry (rows, row groups, tokens, candidates) of a written data file."""
    meta = pq.ParquetFile(path).metadata
    counts = pq.read_table(path, columns=[fmt.HISTORY_TIMESTAMP,
                                          fmt.label_column(schema.tasks[0])])
    return FileEntry(
        path=path.name, rows=meta.num_rows,
        row_groups=tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups)),
        tokens=int(pc.sum(pc.list_value_length(counts.column(0))).as_py() or 0),
        candidates=int(pc.sum(pc.list_value_length(counts.column(1))).as_py() or 0))


def _encodings(schema: Any, features: FeatureSchema | None = None) -> dict[str, str]:
    """Per leaf column, the encoding that decodes fastest (measured on 2-core CPUs, 22 M events:
    three history columns read at 13 M events/s with dictionaries, 20-26 M with these): delta
    bit-packing for integers (rising timestamps and small ids pack well), plain for floats and
    for the ids of ``hash``-policy tables (random 64-bit keys do not pack, and plain decodes
    faster, about 1.4x on nested lists). Pages are not compressed on top: lz4 saved 3 % of the
    size and cost about 5 % of the read time."""
    hashed = set()
    if features is not None:
        hashed = {column for column, _, feature in fmt.id_columns(features)
                  if features.table(feature.table).id_policy in ("hash", "managed")}
    encodings = {}
    for field in schema:
        leaf = field.type
        path = field.name
        while pa.types.is_list(leaf) or pa.types.is_fixed_size_list(leaf):
            leaf = leaf.value_type
            path += ".list.element"
        plain = field.name in hashed or not pa.types.is_integer(leaf)
        encodings[path] = "PLAIN" if plain else "DELTA_BINARY_PACKED"
    return encodings
