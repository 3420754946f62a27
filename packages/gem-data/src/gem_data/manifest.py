"""``manifest.json``: what a data set directory holds (format version, schema, files per split,
request, event and candidate counts).

The manifest is written last by :class:`gem_data.writer.DatasetWriter`, so a directory without one
is an incomplete data set. Paths inside it are relative to the directory, so data sets can move;
a path that leads out of the directory (``..``, an absolute path, a symlink to elsewhere) is
refused, and so is a file listed twice (its rows would be read twice) or by two splits. Each
file's size and SHA-256 are recorded: the reader checks the size whenever it opens a file,
``gem data validate`` the whole digest. Data sets written before digests existed have neither;
``gem data validate --write-digests`` adds them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import attrs

from gem_core.errors import GemDataError
from gem_core.schema import FeatureSchema, schema_from_dict, schema_to_dict
from gem_data.format import FORMAT_VERSION

MANIFEST_NAME = "manifest.json"


@attrs.frozen(kw_only=True)
class FileEntry:
    """One Parquet file of a split."""

    path: str
    """Location relative to the data set directory."""

    rows: int
    """Rows (requests) in the file."""

    row_groups: tuple[int, ...] = attrs.field(converter=tuple)
    """Rows of each row group, in file order; they sum to ``rows``."""

    tokens: int = 0
    """History events in the file (before truncation to ``max_seq_len``)."""

    candidates: int = 0
    """Candidates (impressions) in the file."""

    size: int | None = None
    """Bytes of the file as written; None in a data set written before digests existed."""

    sha256: str | None = None
    """Hex SHA-256 of the file as written; None in a data set written before digests existed."""


@attrs.frozen(kw_only=True)
class Manifest:
    """A data set: its schema and, per split (``train``, ``eval``), its files."""

    schema: FeatureSchema
    """The features every file holds."""

    splits: dict[str, tuple[FileEntry, ...]]
    """Files of each split. ``eval`` may be absent: the source then holds out trailing row
    groups."""

    info: dict[str, Any] = attrs.field(factory=dict)
    """Provenance: which generator or adapter wrote it, with its options and seed."""

    def rows(self, split: str) -> int:
        return sum(f.rows for f in self.splits.get(split, ()))

    def tokens(self, split: str) -> int:
        return sum(f.tokens for f in self.splits.get(split, ()))

    def candidates(self, split: str) -> int:
        return sum(f.candidates for f in self.splits.get(split, ()))

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "schema": schema_to_dict(self.schema),
            "splits": {
                name: {"rows": self.rows(name), "tokens": self.tokens(name),
                       "candidates": self.candidates(name),
                       "files": [{key: value for key, value in attrs.asdict(f).items()
                                  if value is not None} for f in files]}
                for name, files in self.splits.items()
            },
            "info": self.info,
        }


def write_manifest(directory: str | Path, manifest: Manifest) -> Path:
    path = Path(directory) / MANIFEST_NAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest.to_dict(), indent=2) + "\n")
    tmp.replace(path)  # atomic: a reader never sees half a manifest
    return path


def read_manifest(directory: str | Path) -> Manifest:
    """The manifest of a data set directory; GemDataError naming the problem if it is unusable."""
    path = Path(directory) / MANIFEST_NAME
    if not Path(directory).is_dir():
        raise GemDataError(f"data set directory {directory} does not exist")
    if not path.is_file():
        raise GemDataError(f"{path} is missing: {directory} is not a GEM data set "
                           "(make one with `gem data synth` or `gem data fetch`)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise GemDataError(f"{path} is not valid JSON: {error}") from None
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        if version == 1 or version is None:
            raise GemDataError(
                f"{path}: this is a format {version or 1} data set (one row per impression: "
                "history_item_id, history_action, candidate_item_id); this version of gem-data "
                f"reads format {FORMAT_VERSION} (one row per request, schema-declared features). "
                f"Convert it once with `gem data convert {directory} --out NEW_DIR` and point "
                "data.path at NEW_DIR")
        raise GemDataError(f"{path}: format_version {version!r} is not {FORMAT_VERSION} (written "
                           "by a newer gem-data?)")
    try:
        schema = schema_from_dict(data["schema"], where=f"{path}: schema")
        splits = {
            name: tuple(FileEntry(**entry) for entry in split["files"])
            for name, split in data["splits"].items()
        }
    except (KeyError, TypeError, ValueError) as error:
        raise GemDataError(
            f"{path}: malformed manifest ({type(error).__name__}: {error})") from None
    listed: dict[Path, tuple[str, str]] = {}  # resolved file -> (split, path as listed)
    for name, files in splits.items():
        for entry in files:
            file = confined_path(Path(directory), entry.path, where=f"{path}: split {name!r}")
            if sum(entry.row_groups) != entry.rows:
                raise GemDataError(f"{path}: split {name!r} file {entry.path}: row groups sum to "
                                   f"{sum(entry.row_groups)} but rows is {entry.rows}")
            key = file.resolve()
            if key in listed:
                split, first = listed[key]
                same = f" as {first!r}" if first != entry.path else ""
                raise GemDataError(
                    f"{path}: split {name!r} file {entry.path!r} is listed twice in split "
                    f"{name!r}{same}: its rows would be read twice" if split == name else
                    f"{path}: split {name!r} file {entry.path!r} is also a file of split "
                    f"{split!r}{same}: the splits must not share files (the model would be "
                    "evaluated on what it trained on)")
            listed[key] = (name, entry.path)
    if not splits.get("train"):
        raise GemDataError(f"{path}: the data set has no training files")
    return Manifest(schema=schema, splits=splits, info=data.get("info", {}))


def confined_path(directory: Path, relative: str, *, where: str) -> Path:
    """``directory / relative``, refused unless it stays inside ``directory``: no absolute path,
    no ``..`` and no symlink (of the file or a folder on its way) that leads out. A manifest
    comes with a data set from elsewhere; it must not make a run read other files."""
    parts = Path(relative).parts
    if Path(relative).is_absolute() or not parts or ".." in parts:
        raise GemDataError(f"{where}: file path {relative!r} must be relative to the data set "
                           "directory and stay inside it (no absolute path, no '..')")
    root = directory.resolve()
    resolved = (directory / relative).resolve()
    if not resolved.is_relative_to(root):
        raise GemDataError(f"{where}: file path {relative!r} leads out of the data set directory "
                           f"{directory} (to {resolved}, through a symbolic link)")
    return directory / relative


def file_digest(path: Path, chunk_bytes: int = 1 << 20) -> str:
    """Hex SHA-256 of a file, read in chunks (data set files can be many GB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()


def with_digests(directory: Path, manifest: Manifest) -> Manifest:
    """``manifest`` with every file's current size and SHA-256 (what the writer records, and
    ``gem data validate --write-digests`` adds to a data set written before digests)."""
    splits = {
        name: tuple(attrs.evolve(entry, size=(directory / entry.path).stat().st_size,
                                 sha256=file_digest(directory / entry.path))
                    for entry in files)
        for name, files in manifest.splits.items()
    }
    return attrs.evolve(manifest, splits=splits)


def missing_digests(manifest: Manifest) -> list[str]:
    """Files of the manifest without a recorded size or digest (a data set written before
    gem-data recorded them)."""
    return [entry.path for files in manifest.splits.values() for entry in files
            if entry.size is None or entry.sha256 is None]


def unlisted_files(directory: Path, manifest: Manifest) -> list[str]:
    """Parquet files under ``directory`` that no split of the manifest lists: data the manifest
    does not describe would otherwise be skipped without a word."""
    listed = {Path(entry.path) for files in manifest.splits.values() for entry in files}
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*.parquet")
                  if p.is_file() and p.relative_to(directory) not in listed)
