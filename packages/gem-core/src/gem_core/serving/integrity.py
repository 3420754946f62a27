"""The integrity of an export directory: what ``manifest.json`` records of every file, and its
checks.

``gem export-model`` records the size and SHA-256 of every file it writes (``manifest.json``'s
``files``; the manifest itself is the record, so it is not listed). A reader opens an export
through :func:`read_manifest`, which refuses, in one line naming the file, a manifest that is
missing, not JSON, of another format or schema, without programs, or naming a file outside the
export directory (``../model/full.pt2``, an absolute path, a link leading out), and then through
:func:`verify_export`: every recorded file present, of its size and digest (a flipped bit, a
truncated program, another run's program swapped in). ``gem export verify DIR`` reports the
same offline.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gem_core.checkpoint.digests import ALGORITHM, digest_file
from gem_core.errors import GemDataError, GemError
from gem_core.schema import FeatureSchema, schema_from_dict

MANIFEST = "manifest.json"
#: Version of ``manifest.json``. 2: ``files`` records the size and SHA-256 of every file.
MANIFEST_FORMAT = 2
#: The keys of a program entry that name a file of the export.
PROGRAM_FILES = ("file", "aoti_file")


def record_files(directory: Path) -> dict[str, dict[str, Any]]:
    """``name -> {"bytes", "sha256"}`` of every file of ``directory`` but the manifest."""
    directory = Path(directory)
    return {name: {"bytes": (directory / name).stat().st_size,
                   ALGORITHM: digest_file(directory / name)} for name in file_names(directory)}


def file_names(directory: Path) -> list[str]:
    """The relative names of every file of ``directory`` but the manifest, sorted."""
    directory = Path(directory)
    return [p.relative_to(directory).as_posix() for p in sorted(directory.rglob("*"))
            if p.is_file() and p.relative_to(directory).as_posix() != MANIFEST]


def inside(directory: Path, name: Any, where: str) -> Path:
    """``directory / name``; a name that is not a plain relative path inside ``directory``
    (``..``, absolute, a link leading out) is a :class:`GemDataError` naming ``where``."""
    if not isinstance(name, str) or not name or "\\" in name or "\x00" in name:
        raise GemDataError(f"{where}: {name!r} is not a file name of the export")
    path = Path(directory) / name
    if Path(name).is_absolute() or ".." in Path(name).parts or not (
            path.resolve().is_relative_to(Path(directory).resolve())):
        raise GemDataError(f"{where}: {name!r} leaves the export directory {directory}; "
                           "refusing to read it")
    return path


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of the export in ``directory``, checked for shape: format, programs, files
    (names inside the directory). Every problem is one :class:`GemDataError` naming the file."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise GemDataError(f"{directory} is not an export directory (no {MANIFEST}); make one "
                           "with gem export-model RUN_DIR --out DIR")
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise GemDataError(f"{path} is not valid JSON ({error}); the export is damaged: "
                           "export the run again") from None
    if not isinstance(manifest, dict):
        raise GemDataError(f"{path} is not an export manifest (a JSON object)")
    found = manifest.get("format")
    if found != MANIFEST_FORMAT:
        older = isinstance(found, int) and found < MANIFEST_FORMAT
        raise GemDataError(
            f"{path} is of manifest format {found!r}; this version reads format "
            f"{MANIFEST_FORMAT}" + (" (file digests), which older exports lack: export the run "
                                    "again with this version" if older else ""))
    programs = manifest.get("programs")
    if not isinstance(programs, dict) or not programs:
        raise GemDataError(f"{path} lists no programs; the export is damaged or incomplete: "
                           "export the run again")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise GemDataError(f"{path} records no files; export the run again")
    for name, entry in files.items():
        inside(directory, name, f"{path}: files")
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int)
                and isinstance(entry.get(ALGORITHM), str)):
            raise GemDataError(f"{path}: files: the record of {name!r} is not "
                               f"{{bytes, {ALGORITHM}}}")
    for program, entry in programs.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("groups"), list):
            raise GemDataError(f"{path}: program {program!r} is not a program entry")
        for key in PROGRAM_FILES:
            if key not in entry and key == "aoti_file":
                continue
            name = entry.get(key)
            inside(directory, name, f"{path}: program {program!r}")
            if name not in files:
                raise GemDataError(f"{path}: program {program!r} names {name!r}, which the "
                                   "manifest does not record; export the run again")
    for key, kind in (("schema", dict), ("tasks", list), ("checkpoint_step", int)):
        if not isinstance(manifest.get(key), kind):
            raise GemDataError(f"{path} has no {key!r} ({kind.__name__}); the export is "
                               "damaged: export the run again")
    trained_schema(manifest, path)
    return manifest


def trained_schema(manifest: dict[str, Any], path: Path) -> FeatureSchema:
    """The feature schema the exported model was trained on (``manifest``'s, read from
    ``path``); one the schema reader refuses (another version's fields) is a GemDataError."""
    try:
        return schema_from_dict(manifest["schema"], where=str(path))
    except GemError:
        raise
    except (KeyError, TypeError, ValueError) as error:
        raise GemDataError(f"{error} (the model was exported for a schema this version does not "
                           "read); export the run again with this version") from None


def file_problem(directory: Path, name: str, record: dict[str, Any]) -> str | None:
    """What is wrong with recorded file ``name`` of the export in ``directory``, if anything:
    missing, of another size, or of other content."""
    path = Path(directory) / name
    if not path.is_file():
        return f"{name}: missing"
    size = path.stat().st_size
    if size != record["bytes"]:
        return (f"{name}: {size} bytes, written as {record['bytes']} (truncated, overwritten or "
                "replaced)")
    if digest_file(path) != record[ALGORITHM]:
        return f"{name}: content differs from its {ALGORITHM} digest (damaged or replaced)"
    return None


def verify_export(directory: Path, manifest: dict[str, Any]) -> list[str]:
    """Problems of the files ``manifest`` (from :func:`read_manifest`) records, sorted; empty
    when every file is as written."""
    return sorted(problem for name, record in manifest["files"].items()
                  if (problem := file_problem(directory, name, record)) is not None)


def unrecorded_files(directory: Path, manifest: dict[str, Any]) -> list[str]:
    """Files of the export directory its manifest does not list (added later; never read)."""
    return [name for name in file_names(directory) if name not in manifest["files"]]


def open_export(directory: Path) -> dict[str, Any]:
    """:func:`read_manifest` and :func:`verify_export`: the manifest of an export every file of
    which is as written, or one :class:`GemDataError` naming the damaged files."""
    manifest = read_manifest(directory)
    problems = verify_export(directory, manifest)
    if problems:
        raise GemDataError(f"the export in {directory} is damaged: {'; '.join(problems)}. "
                           f"`gem export verify {directory}` lists its files; export the run "
                           "again")
    return manifest
