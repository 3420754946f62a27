"""Opening a data set directory and reading its row groups, checked, with their locations.

A *unit* is one row group of one file: the granule of reading, sharding across ranks, shuffling
and resuming. The manifest lists the units, so planning an epoch opens no file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pyarrow as pa
import pyarrow.parquet as pq

from gem_core.errors import GemDataError
from gem_core.schema import FeatureSchema

from gem_data import format as fmt
from gem_data.arrow_io import ids_as_int64
from gem_data.manifest import Manifest, read_manifest
from gem_data.validation import Location, ValidationPolicy, ValidationReport, validate_table


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


def open_parquet(path: Path, schema: FeatureSchema) -> Any:
    """A ParquetFile after the file-level checks: present, not empty, readable, right schema."""
    if not path.is_file():
        raise GemDataError(f"{path}: file listed in the manifest does not exist")
    if path.stat().st_size == 0:
        raise GemDataError(f"{path}: empty file (0 bytes)")
    try:
        handle = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as error:
        raise GemDataError(f"{path}: truncated or corrupt Parquet file ({error})") from None
    if handle.metadata.num_rows == 0:
        raise GemDataError(f"{path}: empty file (no rows)")
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

    def opened(self, file: str) -> bool:
        """Whether ``file`` passed the file-level checks (it has been opened)."""
        return file in self._handles

    def handle(self, file: str) -> Any:
        if file not in self._handles:
            self._handles[file] = open_parquet(self.directory / file, self.schema)
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
            raise GemDataError(f"{where.file}: row group {unit.row_group}: truncated or corrupt "
                               f"data ({error})") from None
        if table.num_rows != unit.rows:
            raise GemDataError(f"{where.file}: row group {unit.row_group} has {table.num_rows} "
                               f"rows, the manifest says {unit.rows}")
        table = ids_as_int64(table.select(self.columns))  # the canonical column order
        return validate_table(table, self.schema, self.policy, where, self.report,
                              self.max_seq_len)
