"""Opening a data set directory and reading its row groups, checked, with their locations.

A *unit* is one row group of one file: the granule of reading, sharding across ranks, shuffling
and resuming. The manifest lists the units, so planning an epoch opens no file.

Opening a data set checks, cheaply, that the files are the manifest's: no Parquet file the
manifest does not list, each file's size and row groups as recorded, and every page's CRC as it
is read (the writer stores one per page). ``gem data validate`` also compares the SHA-256 of
every file with the manifest's.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import attrs
import pyarrow as pa
import pyarrow.parquet as pq

from gem_core.errors import GemDataError
from gem_core.schema import FeatureSchema
from gem_data import format as fmt
from gem_data.arrow_io import ids_as_int64
from gem_data.manifest import (
    FileEntry,
    Manifest,
    confined_path,
    missing_digests,
    read_manifest,
    unlisted_files,
)
from gem_data.validation import Location, ValidationPolicy, ValidationReport, validate_table

log = logging.getLogger(__name__)

_WARNED_WITHOUT_DIGESTS: set[Path] = set()
"""Data set directories already warned about (once per process, not once per stream)."""


@attrs.frozen
class Unit:
    """One row group of one file of a split."""

    file: str
    """Path relative to the data set directory."""

    row_group: int
    rows: int
    first_row: int
    """Index within the file of the row group's first row."""


def split_units(manifest: Manifest, split: str) -> list[Unit]:
    units = []
    for entry in manifest.splits.get(split, ()):
        first = 0
        for index, rows in enumerate(entry.row_groups):
            units.append(Unit(entry.path, index, rows, first))
            first += rows
    return units


def check_listed_files(directory: Path, manifest: Manifest) -> None:
    """Refuse Parquet files in ``directory`` that the manifest does not list: they would be
    skipped without a word."""
    unlisted = unlisted_files(directory, manifest)
    if unlisted:
        shown = ", ".join(unlisted[:5]) + (f" and {len(unlisted) - 5} more"
                                           if len(unlisted) > 5 else "")
        raise GemDataError(f"{directory}: Parquet files not listed in manifest.json: {shown}. "
                           "Remove them, or rewrite the data set so that its manifest lists "
                           "them")


def warn_without_digests(directory: Path, manifest: Manifest) -> None:
    """Warn (once per data set and process) when the manifest records no sizes and digests: a
    data set written before gem-data recorded them is read, but a damaged or replaced file is
    not detected."""
    missing = missing_digests(manifest)
    if missing and directory.resolve() not in _WARNED_WITHOUT_DIGESTS:
        _WARNED_WITHOUT_DIGESTS.add(directory.resolve())
        log.warning("%s: manifest.json records no size or SHA-256 for %d file(s) (%s; written "
                    "before gem-data recorded them), so a damaged or replaced file is not "
                    "detected; add them with `gem data validate --write-digests %s`",
                    directory, len(missing), missing[0], directory)


def open_parquet(path: Path, schema: FeatureSchema, entry: FileEntry | None = None) -> Any:
    """A ParquetFile after the file-level checks: present, not empty, readable, right schema;
    with ``entry`` (the manifest's record of the file) also its size and row groups. Pages are
    read with their CRCs verified."""
    if not path.is_file():
        raise GemDataError(f"{path}: file listed in the manifest does not exist")
    size = path.stat().st_size
    if size == 0:
        raise GemDataError(f"{path}: empty file (0 bytes)")
    if entry is not None and entry.size is not None and size != entry.size:
        raise GemDataError(f"{path}: {size} bytes where the manifest records {entry.size}: the "
                           "file was truncated, damaged or replaced after the data set was "
                           "written")
    try:
        handle = pq.ParquetFile(path, page_checksum_verification=True)
    except (pa.ArrowException, OSError) as error:
        raise GemDataError(f"{path}: truncated or corrupt Parquet file ({error})") from None
    if handle.metadata.num_rows == 0:
        raise GemDataError(f"{path}: empty file (no rows)")
    if entry is not None:
        meta = handle.metadata
        groups = tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
        if groups != tuple(entry.row_groups):
            raise GemDataError(
                f"{path}: the file has {len(groups)} row groups of {_sizes(groups)} rows but the "
                f"manifest lists {len(entry.row_groups)} of {_sizes(entry.row_groups)}: "
                + ("row groups the manifest does not list would be skipped"
                   if len(groups) > len(entry.row_groups) else "the file is not the one the "
                   "manifest describes"))
    expected = fmt.arrow_schema(schema)
    actual = handle.schema_arrow
    for field in expected:
        index = actual.get_field_index(field.name)
        if index < 0:
            raise GemDataError(f"{path}: schema mismatch: feature {field.name!r} is missing "
                               f"(file columns: {', '.join(actual.names)})")
        found = actual.field(index).type
        if found.equals(field.type):
            continue
        if fmt.is_id_column(field.name) and found.equals(fmt.with_leaf(field.type, pa.uint64())):
            continue  # unsigned 64-bit ids: read as int64 with the same bits
        raise GemDataError(f"{path}: schema mismatch: feature {field.name!r} is {found}, "
                           f"expected {field.type}")
    return handle


def _sizes(groups: tuple[int, ...]) -> str:
    shown = ", ".join(str(g) for g in groups[:6])
    return f"[{shown}{', ...' if len(groups) > 6 else ''}]"


class DatasetReader:
    """Reads checked row groups of one data set. One reader per thread: handles are not shared."""

    def __init__(self, directory: str | Path, *, policy: ValidationPolicy | None = None,
                 report: ValidationReport | None = None, max_seq_len: int | None = None,
                 manifest: Manifest | None = None) -> None:
        self.directory = Path(directory)
        self.manifest = manifest or read_manifest(self.directory)
        self.schema = self.manifest.schema
        self.policy = policy or ValidationPolicy()
        self.report = report if report is not None else ValidationReport()
        self.max_seq_len = max_seq_len
        self.columns = fmt.arrow_schema(self.schema).names
        self._handles: dict[str, Any] = {}
        self._entries = {entry.path: entry for files in self.manifest.splits.values()
                         for entry in files}
        check_listed_files(self.directory, self.manifest)

    def opened(self, file: str) -> bool:
        """Whether ``file`` passed the file-level checks (it has been opened)."""
        return file in self._handles

    def handle(self, file: str) -> Any:
        if file not in self._handles:
            path = confined_path(self.directory, file, where=str(self.directory))
            self._handles[file] = open_parquet(path, self.schema, self._entries.get(file))
        return self._handles[file]

    def read(self, unit: Unit) -> Any:
        """The unit's rows as a table, bad rows dropped or repaired per the policy."""
        handle = self.handle(unit.file)
        where = Location(file=str(self.directory / unit.file), row_group=unit.row_group,
                         first_row=unit.first_row)
        if unit.row_group >= handle.metadata.num_row_groups:
            raise GemDataError(f"{where.file}: row group {unit.row_group} is listed in the "
                               f"manifest but the file has {handle.metadata.num_row_groups}")
        try:
            table = handle.read_row_group(unit.row_group, columns=self.columns)
        except (pa.ArrowException, OSError) as error:
            checksum = " (a page's CRC does not match its data)" if "checksum" in str(
                error).lower() else ""
            raise GemDataError(f"{where.file}: row group {unit.row_group}: truncated or corrupt "
                               f"data{checksum} ({error})") from None
        if table.num_rows != unit.rows:
            raise GemDataError(f"{where.file}: row group {unit.row_group} has {table.num_rows} "
                               f"rows, the manifest says {unit.rows}")
        table = ids_as_int64(table.select(self.columns))  # the canonical column order
        return validate_table(table, self.schema, self.policy, where, self.report,
                              self.max_seq_len)
