"""``gem data import --window NAME`` and ``--append``: a data set of time windows
(:class:`~gem_data.manifest.TimeWindow`) built from logs that arrive one window (a day, say) at a
time.

``--window NAME`` alone imports the logs as a new data set holding one window, NAME. Every
request goes to ``train``: a streaming run evaluates on the window that follows, so there is no
eval split (a non-zero ``[import] eval_fraction`` is not used, and the window's ``info.notes``
and the command's output say so). ``--append`` adds window NAME to such a data set:

- the logs must be later: every request and event after the last window's ``last_time``;
- the schema and ``[import]`` options must be the data set's (``eval_fraction``, unused, and
  the side tables' files, which may be newer snapshots, aside);
- histories continue: the last window's ``history_tail.parquet``
  (:mod:`gem_data.import_history`) holds each user's most recent ``max_seq_len`` events of all
  earlier windows; they come before the new events, so every request gets the history one
  import of all the logs would give it, and the new window's tail is written for the next;
- vocabularies (``import.strings = "vocabulary"``) are the data set's: new values get the
  out-of-vocabulary id, counted per feature;
- users keep their numbers (:func:`~gem_data.import_requests.user_numbers`), and a data set
  whose user ids are text reads them as text also where a window's ids all look like integers,
  as one import of all the logs would.

Atomic: the window is written beside the data set, moved into its ``windows/`` folder, and the
manifest replaced last (:func:`~gem_data.windows.publish_windows`); a failure before the
manifest is replaced removes the new folder, so the data set is left as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import attrs
import numpy as np

from gem_core.errors import GemDataError
from gem_data.import_history import TAIL_FILE
from gem_data.import_log import Log
from gem_data.manifest import Manifest, TimeWindow, file_digest, read_manifest

UNCOMPARED_OPTIONS = ("eval_fraction",)
"""``[import]`` keys an appended window may change: not used for windows."""


@attrs.frozen
class Earlier:
    """The data set a window is appended to, and what the new window continues from."""

    directory: Path
    manifest: Manifest
    tail: Path
    """The last window's history tail (its digest checked)."""
    user_text: bool
    """Whether the data set's user ids are text (numbered by their hash), not integers."""

    @property
    def window(self) -> TimeWindow:
        return self.manifest.windows[-1]

    @property
    def last_time(self) -> int:
        return self.window.last_time

    def events(self, schema: Any) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
        """The tail's user numbers, times and event ids."""
        from gem_data.import_history import read_tail

        return read_tail(self.tail, schema)

    def not_later(self, role: str, time: int, count: int) -> str:
        """The message of a row of the new logs at or before :attr:`last_time`."""
        from gem_data.validation_time import utc_date

        return (f"{role} {time} ({utc_date(time)}) is not after {self.last_time} "
                f"({utc_date(self.last_time)}), the last time of window {self.window.name!r} of "
                f"{self.directory} ({count} such rows): an appended window holds only requests "
                "and events later than every earlier window's")

    def refuse_not_later(self, log: Log, times: np.ndarray, column: str, role: str) -> None:
        """Stop at the first row of ``log`` whose time is at or before :attr:`last_time`."""
        bad = np.flatnonzero(times <= self.last_time)
        if bad.size:
            log.fail(int(bad[0]), column, self.not_later(role, int(times[bad[0]]), bad.size))


# -- the data set appended to -------------------------------------------------------------------


def open_earlier(out: Path, name: str, schema: Any, options: Any, schema_file: Any) -> Earlier:
    """The data set of windows ``out`` that window ``name`` is appended to, after every check
    that needs no log: a data set of windows written by ``gem data import``, without a window
    ``name``, with this schema and these ``[import]`` options, whose last window's history tail
    is intact."""
    from gem_core.schema import schema_to_dict

    if not out.is_dir():
        raise GemDataError(f"--append: {out} does not exist; import the first window without "
                           f"--append (gem data import ... --out {out} --window {name})")
    manifest = read_manifest(out)
    if not manifest.windows:
        raise GemDataError(f"--append: {out} is a data set without time windows (written by "
                           f"{manifest.info.get('source', 'an unknown producer')}); a window is "
                           "appended only to a data set imported with --window")
    if manifest.info.get("source") != "gem data import" or "import" not in manifest.info:
        raise GemDataError(f"--append: the windows of {out} were written by "
                           f"{manifest.info.get('source', 'an unknown producer')}, not by gem "
                           "data import --window: it has no [import] options or history tails "
                           "to continue from")
    names = [w.name for w in manifest.windows]
    if name in names:
        raise GemDataError(f"--append: {out} already has a window {name!r} (its windows: "
                           f"{', '.join(names)}); give the new window a name of its own")
    differ = differences(_plain(schema_to_dict(manifest.schema)), _plain(schema_to_dict(schema)),
                         "")
    differ += differences(_options(manifest.info["import"]), _options(attrs.asdict(options)),
                          "import")
    if differ:
        raise GemDataError(f"--append: {schema_file} differs from the schema and [import] "
                           f"options of {out} in {'; '.join(differ)}; a window is appended "
                           "with the data set's (to change them, import all the logs again "
                           "into a new data set)")
    window = manifest.windows[-1]
    entry = next((e for e in window.state if Path(e.path).name == TAIL_FILE), None)
    if entry is None:
        raise GemDataError(f"--append: window {window.name!r} of {out} has no {TAIL_FILE}, the "
                           "users' latest events the next window's histories continue from")
    tail = out / entry.path
    if not tail.is_file():
        raise GemDataError(f"{tail}: the history tail of window {window.name!r} is missing")
    if tail.stat().st_size != entry.size or file_digest(tail) != entry.sha256:
        raise GemDataError(f"{tail}: the history tail of window {window.name!r} differs from "
                           "the one the manifest records (size or SHA-256); it was changed or "
                           "damaged")
    user_text = manifest.info["requests"].get("user_ids") == "text"
    return Earlier(directory=out, manifest=manifest, tail=tail, user_text=user_text)


def _plain(value: Any) -> Any:
    """``value`` as JSON holds it (tuples are lists), to compare with a manifest's."""
    return json.loads(json.dumps(value))


def _options(options: dict[str, Any]) -> dict[str, Any]:
    """``[import]`` options as compared between windows (:data:`UNCOMPARED_OPTIONS` and the
    side tables' files left out)."""
    plain = {k: v for k, v in _plain(options).items() if k not in UNCOMPARED_OPTIONS}
    plain["join"] = [{k: v for k, v in join.items() if k != "file"} for join in plain["join"]]
    return plain


def differences(before: Any, after: Any, where: str) -> list[str]:
    """Where two JSON values differ, each as ``key (BEFORE in the data set, AFTER here)``:
    objects by key, lists of named objects by name, other lists by position."""
    def at(key: Any) -> str:
        text = str(key)
        quoted = f'"{text}"' if "." in text else text
        return f"{where}.{quoted}" if where else quoted

    if isinstance(before, dict) and isinstance(after, dict):
        keys = list(before) + [k for k in after if k not in before]
        return [d for k in keys for d in differences(before.get(k), after.get(k), at(k))]
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        named = all(isinstance(x, dict) and "name" in x for x in before + after)
        if named and [x["name"] for x in before] == [x["name"] for x in after]:
            return [d for x, y in zip(before, after)
                    for d in differences(x, y, f"{where}[{x['name']!r}]")]
        if not named:
            return [d for i, (x, y) in enumerate(zip(before, after))
                    for d in differences(x, y, f"{where}[{i}]")]
    if before == after:
        return []
    return [f"{where} ({json.dumps(before)} in the data set, {json.dumps(after)} here)"]


# -- importing a window -------------------------------------------------------------------------


def import_window(impressions: str | Path, events: str | Path, schema_file: str | Path,
                  out: str | Path, *, window: str | None, append: bool, row_group_rows: int,
                  vocabulary_from: str | Path | None, engine: str,
                  run_options: dict[str, Any]) -> Manifest:
    """Import the logs as window ``window`` of the data set ``out`` (see the module doc);
    returns the data set's new manifest."""
    from gem_data.import_options import read_schema_file
    from gem_data.import_strings import read_vocabularies
    from gem_data.windows import WindowWriter, publish_windows, window_folder
    from gem_data.writer import staged_directory

    if window is None:
        raise GemDataError("--append adds a window to a data set of windows: name it with "
                           "--window NAME (e.g. --window 2026-11-30)")
    out = Path(out)
    window_folder(out, window)  # a bad name stops the import before any log is read
    schema, options = read_schema_file(schema_file)
    sources = {"impressions": impressions, "events": events, "schema_file": schema_file}
    if not append:
        _refuse_replacing_windows(out, window)
        given = read_vocabularies(vocabulary_from) if vocabulary_from is not None else None
        with staged_directory(out) as staging:
            writer = WindowWriter(staging, schema, window, row_group_rows=row_group_rows)
            report, engine_info = _write(writer, sources, schema, options, given, None, out,
                                         engine, run_options, staging)
            from gem_data.import_build import import_info

            info = import_info(sources, options, report, staging, engine_info)
            new = writer.window(info=_window_info(sources, options, report, engine_info,
                                                  info["vocabularies"]),
                                last_time=report["last_time"])
            return publish_windows(staging, schema, [new], writer.entries, info=info)
    if vocabulary_from is not None:
        raise GemDataError(f"--vocabulary-from does not apply to --append: the window uses the "
                           f"vocabularies of {out}, the data set it is appended to")
    earlier = open_earlier(out, window, schema, options, schema_file)
    given = read_vocabularies(out) if "vocabulary" in options.strings.values() else None
    vocabularies = {table: {**entry, "from": str(out)} for table, entry
                    in earlier.manifest.info.get("vocabularies", {}).items()}
    with _beside(out, window) as staging:
        writer = WindowWriter(staging, schema, window, row_group_rows=row_group_rows)
        report, engine_info = _write(writer, sources, schema, options, given, earlier, out,
                                     engine, run_options, staging)
        new = writer.window(info=_window_info(sources, options, report, engine_info,
                                              vocabularies), last_time=report["last_time"])
        folder = window_folder(out, window)
        _clear_unlisted_folder(earlier.manifest, out, folder)
        folder.parent.mkdir(exist_ok=True)
        writer.folder.rename(folder)  # beside out: the same file system, one rename
        try:
            return publish_windows(out, schema, [new], writer.entries,
                                   previous=earlier.manifest)
        except BaseException:  # not published: take the folder out again, re-raise as is
            if window not in [w.name for w in read_manifest(out).windows]:
                shutil.rmtree(folder)
            raise


def _write(writer: Any, sources: dict[str, Any], schema: Any, options: Any, given: Any,
           earlier: Earlier | None, out: Path, engine: str, run_options: dict[str, Any],
           staging: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Build the window's requests with ``engine``, write them and the history tail with
    ``writer``; the import's report (with ``last_time``) and the engine's description."""
    from gem_data.import_history import TAIL_FILE as TAIL

    where = f"{out} (window {writer.name})"
    windowed = attrs.evolve(options, eval_fraction=0.0)  # every request to train
    if engine == "numpy":
        from gem_data.import_build import _build

        splits, report = _build(sources["impressions"], sources["events"], schema, windowed,
                                given, windowed=True, earlier=earlier)
        batch = splits["train"]
        batch.validate(schema, where=where)
        writer.write(batch)
        writer.write_state(TAIL, report.pop("history_tail"))
        return report, {"name": "numpy"}
    from gem_data.import_engines import open_run, window_functions

    history_tail, last_time = window_functions(engine)
    with open_run(engine, sources["impressions"], sources["events"], schema, windowed,
                  vocabularies=given, earlier=earlier, run_options=run_options,
                  staging=staging) as run:
        report = run.prepare()
        run.write(_TrainOnly(writer), where, writer.row_group_rows)
        writer.write_state(TAIL, history_tail(run, writer.row_group_rows))
        report["last_time"] = last_time(run)
        return report, run.engine_info()


class _TrainOnly:
    """A :class:`~gem_data.windows.WindowWriter` as the DuckDB and Spark engines write splits (a
    window has train only)."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def write(self, split: str, table: Any) -> None:
        if split != "train":
            raise AssertionError(f"a window has no {split!r} split")
        self.writer.write(table)


def _window_info(sources: dict[str, Any], options: Any, report: dict[str, Any],
                 engine_info: dict[str, Any], vocabularies: dict[str, Any]) -> dict[str, Any]:
    """A window's ``info``: its logs, requests, features' counts, vocabularies, engine, the
    history tail's size, and notes for the reader."""
    notes = []
    if options.eval_fraction:
        notes.append(f"import.eval_fraction = {options.eval_fraction:g} is not used for "
                     "windows: every request is in train (a streaming run evaluates on the "
                     "next window)")
    return {"source": "gem data import", **{key: str(value) for key, value in sources.items()},
            "requests": report["requests"], "features": report["features"],
            "vocabularies": vocabularies, "engine": engine_info, "notes": notes}


def _refuse_replacing_windows(out: Path, window: str) -> None:
    """A data set of windows at ``out`` is appended to, never replaced by an import of one
    window without ``--append`` (a missing flag would drop every earlier window)."""
    from gem_data.manifest import MANIFEST_NAME

    if not (out / MANIFEST_NAME).is_file():
        return
    try:
        names = [w.name for w in read_manifest(out).windows]
    except GemDataError:
        return  # not a readable data set: staged_directory decides what to do with it
    if names:
        raise GemDataError(f"{out} is a data set of windows ({', '.join(names)}): add "
                           f"--append to add window {window!r} to it, or remove it first to "
                           "start a new one")


def _clear_unlisted_folder(manifest: Manifest, out: Path, folder: Path) -> None:
    """Remove ``folder`` (the new window's) if an earlier append left it (failing after moving
    it in); refuse if the manifest lists a file there."""
    from gem_data.manifest import all_files

    inside = [e.path for e in all_files(manifest)
              if (out / e.path).resolve().is_relative_to(folder.resolve())]
    if inside:
        raise GemDataError(f"{folder}: the data set's files {', '.join(inside[:3])} are in the "
                           "new window's folder; give the window another name")
    if folder.exists():
        shutil.rmtree(folder)


@contextlib.contextmanager
def _beside(out: Path, window: str) -> Iterator[Path]:
    """A work directory beside ``out`` (the same file system: the window's folder is moved in
    with one rename), removed when the block ends, however it ends."""
    staging = out.resolve().parent / f".{out.name}.append-{window}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def describe_window(manifest: Manifest, out: Any) -> list[str]:
    """What ``gem data import --window`` prints: the window written, the data set's windows,
    the notes (an unused ``eval_fraction``) and :func:`~gem_data.importer.describe_import`'s
    lines of the window."""
    from gem_data.import_build import describe_import
    from gem_data.validation_time import utc_date

    window = manifest.windows[-1]
    entries = {entry.path: entry for entry in manifest.splits["train"]}
    tokens = sum(entries[path].tokens for path in window.files)
    tail = ", ".join(f"{Path(e.path).name} ({e.rows} events)" for e in window.state)
    return [f"wrote window {window.name!r} to {out}: {manifest.window_rows(window)} requests "
            f"({tokens} history events) from {utc_date(window.first_time)} to "
            f"{utc_date(window.last_time)}; state: {tail}; the data set has "
            f"{len(manifest.windows)} windows, {manifest.rows('train')} requests",
            *window.info.get("notes", []), *describe_import(window.info)]
