"""Whole-data-set checks and descriptions behind ``gem data validate`` and ``gem data inspect``."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gem_core.config.loading import toml_key, toml_literal
from gem_core.errors import GemDataError
from gem_core.ids import collision_report
from gem_core.schema import FeatureSchema, schema_from_dict, schema_to_dict
from gem_data import format as fmt
from gem_data.arrow_io import ids_as_int64, list_child, numpy_view, single_array
from gem_data.dataset import DatasetReader, open_parquet, split_units
from gem_data.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    all_files,
    file_digest,
    missing_digests,
    read_manifest,
    with_digests,
    write_manifest,
)


def load_schema_file(path: str | Path) -> FeatureSchema:
    """The :class:`FeatureSchema` of a user-written TOML file (see docs/data-format.md); an
    ``[import]`` table (``gem data import``'s options) is read and checked as the import reads
    it, and left out of the result (see :func:`read_schema_and_import`)."""
    return read_schema_and_import(path)[0]


def read_schema_and_import(path: str | Path) -> tuple[FeatureSchema, Any]:
    """A schema file's :class:`FeatureSchema` and its ``[import]`` table as
    :class:`gem_data.import_options.ImportOptions` as written (side-table paths as given), or
    None when it has none. Every command that takes a schema file reads it here, so a file is
    accepted or refused the same way by all of them: with ``[import]``, by the importer's own
    parser (:func:`gem_data.import_options.read_schema_file`, with its checks of the table
    against the schema); without, by :func:`gem_core.schema.schema_from_dict` (a file that is
    one ``[schema]`` table is accepted too)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as error:
        raise GemDataError(f"{path}: cannot read the schema file ({error})") from None
    except tomllib.TOMLDecodeError as error:
        raise GemDataError(f"{path}: not valid TOML ({error})") from None
    if "import" in data:
        from gem_core.config import structure
        from gem_data.import_options import ImportOptions, read_schema_file

        schema, _ = read_schema_file(path)  # the import's parser and checks, its errors
        return schema, structure(ImportOptions, data["import"], "import")
    if "schema" in data and isinstance(data["schema"], dict) and len(data) == 1:
        data = data["schema"]  # a [schema] table is accepted too
    try:
        return schema_from_dict(data, where=str(path)), None
    except ValueError as error:
        raise GemDataError(str(error)) from None


def import_to_toml(options: Any) -> str:
    """An ``[import]`` table (:class:`gem_data.import_options.ImportOptions`) as TOML, every key
    with the value that applies (defaults included; keys without a value left out)."""
    data = attrs.asdict(options)
    lines = ["[import]"]
    lines += [f"{toml_key(k)} = {toml_literal(v)}" for k, v in data.items()
              if v is not None and not isinstance(v, dict) and k != "join"]
    for key in ("columns", "strings", "features"):
        if data[key]:
            lines += ["", f"[import.{key}]"]
            lines += [f"{toml_key(k)} = {toml_literal(_without_none(v))}"
                      for k, v in data[key].items()]
    for join in data["join"]:
        lines += ["", "[[import.join]]"]
        lines += [f"{toml_key(k)} = {toml_literal(_without_none(v))}" for k, v in join.items()
                  if v is not None]
    return "\n".join(lines) + "\n"


def _without_none(value: Any) -> Any:
    """``value`` with the None values of its tables left out (TOML has no null: a key without
    a value is not written)."""
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    return value


def schema_differences(a: FeatureSchema, b: FeatureSchema) -> list[str]:
    """Fields in which two schemas differ, worded for a report."""
    da, db = schema_to_dict(a), schema_to_dict(b)
    return [f"{key}: {da[key]!r} != {db[key]!r}" for key in da if da[key] != db.get(key)]


def manifest_of_files(directory: Path, schema: FeatureSchema) -> Manifest:
    """A manifest for a directory of Parquet files without one (a user's own export): every
    ``*.parquet`` file is a training file."""
    files = sorted(p for p in directory.glob("*.parquet") if p.is_file())
    if not files:
        raise GemDataError(f"{directory} holds neither {MANIFEST_NAME} nor *.parquet files")
    entries = []
    for path in files:
        try:
            meta = pq.ParquetFile(path).metadata
        except (pa.ArrowException, OSError) as error:
            raise GemDataError(f"{path}: truncated or corrupt Parquet file ({error})") from None
        groups = tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
        entries.append(FileEntry(path=path.name, rows=sum(groups), row_groups=groups))
    return Manifest(schema=schema, splits={"train": tuple(entries)},
                    info={"source": "files without a manifest"})


def validate_dataset(directory: Path, schema: FeatureSchema | None = None, *,
                     write_digests: bool = False) -> dict[str, Any]:
    """Check every file's SHA-256 against the manifest's, then every row group of every split
    with the strict policy; one error per bad file or row group, each naming file, row group,
    row, feature and value. With ``schema`` (a user's TOML schema), the files are checked
    against it instead of the manifest's schema (a directory of Parquet files without a
    manifest works too). ``write_digests``: when everything passed and the manifest records no
    sizes and digests (a data set written before gem-data recorded them), record them."""
    errors: list[str] = []
    result: dict[str, Any] = {"directory": str(directory), "opened": False, "files": 0,
                              "files_unreadable": [], "files_damaged": [], "rows_checked": 0,
                              "row_groups": 0, "row_groups_listed": 0, "warnings": []}
    try:
        if schema is not None and not (directory / MANIFEST_NAME).is_file():
            manifest = manifest_of_files(directory, schema)
        else:
            manifest = read_manifest(directory)
            if schema is not None:
                differences = schema_differences(schema, manifest.schema)
                result["schema_differences"] = differences
                manifest = attrs.evolve(manifest, schema=schema)
        reader = DatasetReader(directory, manifest=manifest)
    except GemDataError as error:
        return {**result, "errors": [str(error)]}
    checked = 0
    broken_files: set[str] = set()
    damaged_files: list[str] = []
    state_files = {entry.path for window in reader.manifest.windows for entry in window.state}
    for entry in all_files(reader.manifest):  # the splits' files, then the windows' state files
        if entry.path in state_files and not (directory / entry.path).is_file():
            # Training never opens a state file, so its absence is reported here.
            broken_files.add(entry.path)
            errors.append(f"{directory / entry.path}: state file listed in the manifest does not "
                          "exist (the next window appended continues from it)")
            continue
        if entry.sha256 is None or not (directory / entry.path).is_file():
            continue  # a missing data file is reported when it is opened
        actual = file_digest(directory / entry.path)
        if actual != entry.sha256:
            damaged_files.append(entry.path)
            errors.append(f"{directory / entry.path}: SHA-256 {actual} differs from the "
                          f"manifest's {entry.sha256}: the file was damaged or replaced "
                          "after the data set was written")
    missing = missing_digests(reader.manifest)
    if missing and (directory / MANIFEST_NAME).is_file() and not write_digests:
        result["warnings"].append(
            f"manifest.json records no size or SHA-256 for {len(missing)} file(s) (written "
            "before gem-data recorded them): damage to them is found only where it breaks the "
            f"format; add them with `gem data validate --write-digests {directory}`")
    for split in reader.manifest.splits:
        for unit in split_units(reader.manifest, split):
            if unit.file in broken_files:
                continue
            try:
                reader.read(unit)
            except GemDataError as error:
                errors.append(str(error))
                if not reader.opened(unit.file):  # the file itself failed to open
                    broken_files.add(unit.file)
                continue
            checked += 1
    if write_digests:
        if not (directory / MANIFEST_NAME).is_file():
            errors.append(f"{directory}: --write-digests needs a manifest.json (write the data "
                          "set with gem-data first)")
        elif errors:
            result["warnings"].append("digests not written: the data set has errors")
        elif missing:
            write_manifest(directory, with_digests(directory, read_manifest(directory)))
            result["digests_written"] = len(missing)
    listed = [entry.path for files in reader.manifest.splits.values() for entry in files]
    return {**result, "opened": True, "files": len(listed), "state_files": len(state_files),
            "files_unreadable": [f for f in listed + sorted(state_files) if f in broken_files],
            "files_damaged": damaged_files, "rows_checked": reader.report.rows_checked,
            "row_groups": checked,
            "row_groups_listed": sum(len(split_units(reader.manifest, split))
                                     for split in reader.manifest.splits),
            "errors": errors}


def validation_summary(result: dict[str, Any]) -> str:
    """The last line of ``gem data validate``: what was checked (files, row groups, requests),
    which files could not be read or differ from their digests, and the number of errors."""
    errors = len(result["errors"])
    where = result["directory"]
    if not result["opened"]:
        return (f"{where}: the data set could not be opened (its manifest or files), so no file "
                f"was checked; {errors} error{'s' if errors != 1 else ''}")
    state = f" (and {result['state_files']} state files)" if result.get("state_files") else ""
    parts = [f"{result['files']} files{state}, {result['row_groups']} of "
             f"{result['row_groups_listed']} row groups and {result['rows_checked']} requests "
             "checked"]
    if result["files_unreadable"]:
        parts.append(f"{len(result['files_unreadable'])} of {result['files']} files could not "
                     f"be read ({', '.join(result['files_unreadable'])})")
    if result["files_damaged"]:
        parts.append(f"{len(result['files_damaged'])} files differ from their recorded SHA-256 "
                     f"({', '.join(result['files_damaged'])})")
    return f"{where}: " + "; ".join(parts) + f"; {errors} error{'s' if errors != 1 else ''}"


def _leaf_ids(column: Any) -> np.ndarray:
    array = single_array(column)
    while pa.types.is_list(array.type):
        array = list_child(array)[0]
    return numpy_view(array)


def describe_dataset(directory: Path) -> dict[str, Any]:
    """Per split: requests, events, candidates, the distributions of history lengths and of
    candidates per request, label rates. Per table: its id policy and how the data set's
    distinct ids share its rows (``gem_core.ids.collision_report``)."""
    manifest = read_manifest(directory)
    schema = manifest.schema
    first_candidate = fmt.candidate_column(schema.candidate_features[0].name)
    id_columns = {column: feature.table for column, _, feature in fmt.id_columns(schema)}
    distinct: dict[str, list[np.ndarray]] = {t.name: [] for t in schema.tables}
    splits = {}
    for split, files in manifest.splits.items():
        lengths, counts = [], []
        positives = dict.fromkeys(schema.tasks, 0.0)
        for entry in files:
            open_parquet(directory / entry.path, schema)
            columns = ([fmt.HISTORY_TIMESTAMP, first_candidate] + list(id_columns)
                       + [fmt.label_column(t) for t in schema.tasks])
            table = ids_as_int64(pq.read_table(directory / entry.path,
                                               columns=list(dict.fromkeys(columns))))
            lengths.append(np.diff(list_child(single_array(table.column(
                fmt.HISTORY_TIMESTAMP)))[1]))
            counts.append(np.diff(list_child(single_array(table.column(first_candidate)))[1]))
            for task in schema.tasks:
                positives[task] += float(_leaf_ids(table.column(fmt.label_column(task))).sum())
            for column, table_name in id_columns.items():
                # Distinct per file first keeps memory at the vocabulary, not the data.
                distinct[table_name].append(np.unique(_leaf_ids(table.column(column))))
        n = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
        k = np.concatenate(counts) if counts else np.zeros(0, dtype=np.int64)
        values, frequency = np.unique(k, return_counts=True)
        impressions = int(k.sum())
        splits[split] = {
            "requests": manifest.rows(split),
            "rows": manifest.rows(split),  # one row per request
            "history_events": manifest.tokens(split),
            "candidates": impressions,
            "files": [entry.path for entry in files],
            "row_groups": sum(len(entry.row_groups) for entry in files),
            "history_length": _percentiles(n),
            "empty_histories": float((n == 0).mean()) if n.size else 0.0,
            "candidates_per_request": {**_percentiles(k), "histogram": {
                str(int(v)): int(c) for v, c in zip(values[:32], frequency[:32])}},
            "label_rate": {task: (positives[task] / impressions if impressions else 0.0)
                           for task in schema.tasks},
        }
    tables = {}
    for table in schema.tables:
        ids = (np.unique(np.concatenate(distinct[table.name])) if distinct[table.name]
               else np.zeros(0, dtype=np.int64))
        report = collision_report(ids, table)
        if table.id_policy == "dense" and ids.size:
            report["out_of_range_ids"] = int(((ids < 0) | (ids >= table.num_embeddings)).sum())
        tables[table.name] = {"num_embeddings": table.num_embeddings,
                              "id_policy": table.id_policy, **report}
    described = {"directory": str(directory), "format_version": fmt.FORMAT_VERSION,
                 "splits": splits}
    if manifest.windows:
        described["windows"] = describe_windows(manifest)
    return {**described, "tables": tables, "schema": schema_to_dict(schema),
            "info": manifest.info}


def describe_windows(manifest: Manifest) -> list[dict[str, Any]]:
    """Per time window, oldest first: its name, time range (seconds and UTC), requests, history
    events (in its requests' histories), files and state files (path, rows, bytes)."""
    import datetime

    def utc(seconds: int) -> str | None:
        try:
            return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat()
        except (OverflowError, OSError, ValueError):
            return None  # not a representable date (a time in another unit than seconds)

    entries = {entry.path: entry for entry in manifest.splits["train"]}
    return [{"name": w.name, "first_time": w.first_time, "first_time_utc": utc(w.first_time),
             "last_time": w.last_time, "last_time_utc": utc(w.last_time),
             "requests": manifest.window_rows(w),
             "history_events": sum(entries[path].tokens for path in w.files),
             "files": list(w.files),
             "state": [{"path": e.path, "rows": e.rows, "size": e.size} for e in w.state]}
            for w in manifest.windows]


def _percentiles(lengths: np.ndarray) -> dict[str, float]:
    if lengths.size == 0:
        return {}
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    return {"mean": float(lengths.mean()), "p50": float(p50), "p90": float(p90),
            "p99": float(p99), "min": int(lengths.min()), "max": int(lengths.max())}


def schema_to_toml(schema: FeatureSchema) -> str:
    """The schema as the TOML a user writes (what ``gem data schema show`` prints)."""
    data = schema_to_dict(schema)
    lines = [f"{toml_key(k)} = {toml_literal(v)}" for k, v in data.items()
             if not isinstance(v, (list, tuple)) or not v or not isinstance(v[0], dict)]
    for key, items in data.items():
        if isinstance(items, (list, tuple)) and items and isinstance(items[0], dict):
            for item in items:
                lines += ["", f"[[{toml_key(key)}]]"]
                lines += [f"{toml_key(k)} = {toml_literal(v)}" for k, v in item.items()]
    return "\n".join(lines) + "\n"
