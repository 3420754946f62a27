"""``manifest.json``: what a data set directory holds (format version, schema, files per split,
request, event and candidate counts).

The manifest is written last by :class:`gem_data.writer.DatasetWriter`, so a directory without one
is an incomplete data set. Paths inside it are relative to the directory, so data sets can move;
a path that leads out of the directory (``..``, an absolute path, a symlink to elsewhere) is
refused, and so is a file listed twice (its rows would be read twice) or by two splits. Each
file's size and SHA-256 are recorded: the reader checks the size whenever it opens a file,
``gem data validate`` the whole digest. Data sets written before digests existed have neither;
``gem data validate --write-digests`` adds them.

A data set may hold many **time windows** (``windows``: e.g. one per day of logs, added by ``gem
data import --append`` or written by ``gem data synth --windows``): each names its training files,
in reading order, and the time range it covers; consecutive windows do not overlap in time. The
training split is then the windows' files, window after window. A window may also list *state*
files, which training never reads: what the next append needs (for instance each user's most
recent events), recorded with size and digest like every other file.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import attrs

from gem_core.errors import GemDataError
from gem_core.schema import FeatureSchema, schema_from_dict, schema_to_dict
from gem_data.format import FORMAT_VERSION

MANIFEST_NAME = "manifest.json"

WINDOWS_FOLDER = "windows"
"""Folder of a data set directory holding one folder per time window."""

WINDOW_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=-]{0,127}")
"""A window's name: a path segment (it names the window's folder), e.g. ``2026-11-30``."""


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
class TimeWindow:
    """One time window of a data set that holds many (see the module documentation)."""

    name: str
    """Unique within the data set, e.g. ``2026-11-30`` (:data:`WINDOW_NAME`)."""

    files: tuple[str, ...] = attrs.field(converter=tuple)
    """Paths of this window's files of split ``train``, in reading order."""

    first_time: int
    """Earliest request time (``request_timestamp``, seconds) in the window."""

    last_time: int
    """Latest request or event time the window covers: every request and event of a later
    window is later than this."""

    state: tuple[FileEntry, ...] = attrs.field(default=(), converter=tuple)
    """Files training never reads: what the next append needs (e.g. each user's most recent
    events up to ``last_time``), each with its size and digest."""

    info: dict[str, Any] = attrs.field(factory=dict)
    """Provenance of the window: what wrote it, from which logs, with which counts."""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "files": list(self.files), "first_time": self.first_time,
                "last_time": self.last_time,
                "state": [{key: value for key, value in attrs.asdict(f).items()
                           if value is not None} for f in self.state],
                "info": self.info}


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

    windows: tuple[TimeWindow, ...] = attrs.field(default=(), converter=tuple)
    """The time windows, oldest first, whose files make up split ``train`` in this order; empty
    for a data set that is not divided into windows."""

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
            # Only when there are windows: the manifests (and digests) of other data sets stay
            # as they were.
            **({"windows": [w.to_dict() for w in self.windows]} if self.windows else {}),
        }

    def window_rows(self, window: TimeWindow) -> int:
        """Requests in ``window``'s files."""
        entries = {entry.path: entry for entry in self.splits.get("train", ())}
        return sum(entries[path].rows for path in window.files)


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
    return parse_manifest(data, Path(directory), path)


def checked(directory: str | Path, manifest: Manifest) -> Manifest:
    """``manifest`` after the checks :func:`read_manifest` makes, before it is written (a
    producer never publishes a manifest readers would refuse)."""
    return parse_manifest(json.loads(json.dumps(manifest.to_dict())), Path(directory),
                          Path(directory) / MANIFEST_NAME)


def parse_manifest(data: Any, directory: Path, path: Path) -> Manifest:
    """The manifest in ``data`` (parsed JSON) of the data set ``directory``, checked."""
    if not isinstance(data, dict):
        raise GemDataError(f"{path}: malformed manifest (not a JSON object)")
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
        windows = tuple(
            TimeWindow(**{**window, "state": tuple(FileEntry(**f)
                                                   for f in window.get("state", ()))})
            for window in data.get("windows", ()))
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
    check_windows(Path(directory), path, windows, splits, listed)
    return Manifest(schema=schema, splits=splits, info=data.get("info", {}), windows=windows)


def check_windows(directory: Path, path: Path, windows: tuple[TimeWindow, ...],
                  splits: dict[str, tuple[FileEntry, ...]],
                  listed: dict[Path, tuple[str, str]]) -> None:
    """Refuse windows that do not describe split ``train`` exactly: a bad name, a name twice,
    overlapping or unordered time ranges, a file of no window or of two, files in another order
    than the split's, or a state file that is also a data file."""
    if not windows:
        return
    seen: set[str] = set()
    previous: TimeWindow | None = None
    for window in windows:
        where = f"{path}: window {window.name!r}"
        if not WINDOW_NAME.fullmatch(window.name):
            raise GemDataError(f"{where}: a window name is letters, digits and . _ = - (at most "
                               "128, not starting with a punctuation mark)")
        if window.name in seen:
            raise GemDataError(f"{where} is listed twice")
        seen.add(window.name)
        if not window.files:
            raise GemDataError(f"{where} has no files")
        if window.first_time > window.last_time:
            raise GemDataError(f"{where}: first_time {window.first_time} is after last_time "
                               f"{window.last_time}")
        if previous is not None and window.first_time <= previous.last_time:
            raise GemDataError(
                f"{where} starts at {window.first_time}, not after window {previous.name!r} "
                f"ends ({previous.last_time}): windows are listed oldest first and do not "
                "overlap in time")
        for entry in window.state:
            file = confined_path(directory, entry.path, where=f"{where} state")
            if file.resolve() in listed:
                raise GemDataError(f"{where}: state file {entry.path!r} is also a data file")
            listed[file.resolve()] = ("state", entry.path)
        previous = window
    in_windows = [file for window in windows for file in window.files]
    in_split = [entry.path for entry in splits["train"]]
    if in_windows != in_split:
        unassigned = sorted(set(in_split) - set(in_windows))
        unknown = sorted(set(in_windows) - set(in_split))
        twice = sorted({f for f in in_windows if in_windows.count(f) > 1})
        problem = (f"train files in no window: {', '.join(unassigned[:3])}" if unassigned else
                   f"window files that are not train files: {', '.join(unknown[:3])}" if unknown
                   else f"files in two windows: {', '.join(twice[:3])}" if twice else
                   "the windows list the train files in another order than the split")
        raise GemDataError(f"{path}: the windows do not describe split 'train' ({problem})")


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
    def digested(entry: FileEntry) -> FileEntry:
        return attrs.evolve(entry, size=(directory / entry.path).stat().st_size,
                            sha256=file_digest(directory / entry.path))

    splits = {name: tuple(digested(e) for e in files) for name, files in manifest.splits.items()}
    windows = tuple(attrs.evolve(w, state=tuple(digested(e) for e in w.state))
                    for w in manifest.windows)
    return attrs.evolve(manifest, splits=splits, windows=windows)


def all_files(manifest: Manifest) -> list[FileEntry]:
    """Every file the manifest records: each split's, then each window's state files."""
    return ([entry for files in manifest.splits.values() for entry in files]
            + [entry for window in manifest.windows for entry in window.state])


def missing_digests(manifest: Manifest) -> list[str]:
    """Files of the manifest without a recorded size or digest (a data set written before
    gem-data recorded them)."""
    return [entry.path for entry in all_files(manifest)
            if entry.size is None or entry.sha256 is None]


def unlisted_files(directory: Path, manifest: Manifest) -> list[str]:
    """Parquet files under ``directory`` that no split of the manifest lists: data the manifest
    does not describe would otherwise be skipped without a word."""
    listed = {Path(entry.path) for files in manifest.splits.values() for entry in files}
    listed |= {Path(entry.path) for window in manifest.windows for entry in window.state}
    windows = {window.name for window in manifest.windows}

    def pending(relative: Path) -> bool:
        # windows/<name>/ of no window: an append that has not published its manifest yet (or
        # failed before it did); it is not data of this data set, and readers go on meanwhile
        parts = relative.parts
        return (len(parts) > 2 and parts[0] == WINDOWS_FOLDER and bool(windows)
                and parts[1] not in windows)

    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*.parquet")
                  if p.is_file() and p.relative_to(directory) not in listed
                  and not pending(p.relative_to(directory)))
