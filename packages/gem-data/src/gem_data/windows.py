"""Writing the time windows of a data set (:class:`gem_data.manifest.TimeWindow`): each window's
files under ``windows/<name>/``, then a manifest listing the windows oldest first.

Producers (``gem data synth --windows``, ``gem data import --window`` and ``--append``) write a
window's requests with :class:`WindowWriter` and publish the data set's new manifest with
:func:`publish_windows`. Appending never rewrites an earlier window's files: the new window's
folder is written first, the manifest replaced last (one rename), so a failed append leaves the
data set as it was, apart from a folder no manifest lists, which the next append of that name
removes.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import attrs
import pyarrow as pa

from gem_core.batch import JaggedBatch
from gem_core.errors import GemDataError
from gem_core.schema import FeatureSchema
from gem_data import format as fmt
from gem_data.arrow_io import batch_to_table
from gem_data.manifest import (
    WINDOW_NAME,
    WINDOWS_FOLDER,
    FileEntry,
    Manifest,
    TimeWindow,
    checked,
    file_digest,
    write_manifest,
)
from gem_data.writer import write_file


def window_folder(directory: Path, name: str) -> Path:
    """Where window ``name``'s files live, refused unless ``name`` is a valid window name."""
    if not WINDOW_NAME.fullmatch(name):
        raise GemDataError(f"window name {name!r}: use letters, digits and . _ = - (at most 128, "
                           "starting with a letter or digit), e.g. 2026-11-30")
    return directory / WINDOWS_FOLDER / name


def _digested(directory: Path, entry: FileEntry) -> FileEntry:
    path = directory / entry.path
    return attrs.evolve(entry, size=path.stat().st_size, sha256=file_digest(path))


class WindowWriter:
    """Writes one window's requests (tables with the data set's arrow schema, or JaggedBatch) as
    files of at most ``file_rows`` requests in row groups of ``row_group_rows``, and its state
    files; :meth:`window` returns the finished :class:`TimeWindow`. Requests are written in the
    order given: give them in time order (training reads a window's files in this order)."""

    def __init__(self, directory: str | Path, schema: FeatureSchema, name: str, *,
                 row_group_rows: int = 16384, file_rows: int = 1 << 20) -> None:
        self.directory = Path(directory)
        self.schema, self.name = schema, name
        self.row_group_rows, self.file_rows = row_group_rows, file_rows
        self.folder = window_folder(self.directory, name)
        if self.folder.exists():  # left by an append that failed before its manifest
            shutil.rmtree(self.folder)
        self.folder.mkdir(parents=True)
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self.files: list[FileEntry] = []
        self.state: list[FileEntry] = []
        self.first_time: int | None = None
        self.last_time: int | None = None

    def write(self, data: JaggedBatch | pa.Table) -> None:
        table = batch_to_table(data, self.schema) if isinstance(data, JaggedBatch) else data
        if table.num_rows == 0:
            return
        self._see_times(table)
        self._pending.append(table)
        self._pending_rows += table.num_rows
        while self._pending_rows >= self.file_rows:
            self._flush(self.file_rows)

    def _see_times(self, table: pa.Table) -> None:
        import pyarrow.compute as pc

        requests = table.column(fmt.REQUEST_TIMESTAMP)
        low, high = pc.min(requests).as_py(), pc.max(requests).as_py()
        events = pc.max(pc.list_flatten(table.column(fmt.HISTORY_TIMESTAMP))).as_py()
        self.first_time = low if self.first_time is None else min(self.first_time, low)
        for value in (high, events):
            if value is not None:
                self.last_time = value if self.last_time is None else max(self.last_time, value)

    def _flush(self, rows: int) -> None:
        table = pa.concat_tables(self._pending)
        head, rest = table.slice(0, rows), table.slice(rows)
        self._pending = [rest] if rest.num_rows else []
        self._pending_rows = rest.num_rows
        path = self.folder / f"train-{len(self.files):05d}.parquet"
        entry = write_file(path, head.combine_chunks(), self.schema,
                           row_group_rows=self.row_group_rows)
        self.files.append(_digested(self.directory, attrs.evolve(
            entry, path=str(path.relative_to(self.directory)))))

    def write_state(self, filename: str, table: pa.Table | pa.RecordBatchReader) -> FileEntry:
        """Write a state file (not read by training) of this window, e.g. each user's most
        recent events; it is listed with its size and digest. ``table``: a table (one row
        group), or a reader whose batches are written one row group each (a state streamed
        from an out-of-core engine, larger than memory)."""
        import pyarrow.parquet as pq

        path = self.folder / filename
        partial = path.with_name(path.name + ".partial")
        if isinstance(table, pa.RecordBatchReader):
            with pq.ParquetWriter(partial, table.schema, write_page_checksum=True) as writer:
                for batch in table:
                    if batch.num_rows:
                        writer.write_batch(batch, row_group_size=batch.num_rows)
        else:
            pq.write_table(table, partial, row_group_size=max(table.num_rows, 1),
                           write_page_checksum=True)
        partial.replace(path)
        meta = pq.ParquetFile(path).metadata
        entry = _digested(self.directory, FileEntry(
            path=str(path.relative_to(self.directory)), rows=meta.num_rows,
            row_groups=tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))))
        self.state.append(entry)
        return entry

    def window(self, *, info: dict[str, Any] | None = None, first_time: int | None = None,
               last_time: int | None = None) -> TimeWindow:
        """The finished window. ``first_time`` / ``last_time`` widen the range seen in the
        requests (e.g. to the end of the day the window stands for, or the last event of the
        event log, which later windows' events must follow)."""
        if self._pending_rows:
            self._flush(self._pending_rows)
        if not self.files:
            raise GemDataError(f"window {self.name!r} has no requests")
        first = self.first_time if first_time is None else min(first_time, self.first_time)
        last = self.last_time if last_time is None else max(last_time, self.last_time)
        return TimeWindow(name=self.name, files=tuple(f.path for f in self.files),
                          first_time=int(first), last_time=int(last), state=tuple(self.state),
                          info=dict(info or {}))

    @property
    def entries(self) -> list[FileEntry]:
        return list(self.files)


def publish_windows(directory: str | Path, schema: FeatureSchema, windows: list[TimeWindow],
                    entries: list[FileEntry], *, previous: Manifest | None = None,
                    info: dict[str, Any] | None = None,
                    eval_files: tuple[FileEntry, ...] = ()) -> Manifest:
    """Write the manifest of ``directory``: ``previous``'s windows (if appending) followed by
    ``windows``, whose files are ``entries``; ``info`` replaces the data set's provenance when
    given. The manifest is replaced in one rename, so readers see the old or the new data set."""
    directory = Path(directory)
    if previous is not None and previous.schema != schema:
        raise GemDataError(f"{directory}: the new window's schema differs from the data set's")
    old_windows = previous.windows if previous is not None else ()
    old_train = previous.splits.get("train", ()) if previous is not None else ()
    names = [w.name for w in old_windows]
    for window in windows:
        if window.name in names:
            raise GemDataError(f"{directory}: the data set already has a window {window.name!r}")
        names.append(window.name)
    splits: dict[str, tuple[FileEntry, ...]] = {"train": (*old_train, *entries)}
    kept_eval = previous.splits.get("eval", ()) if previous is not None else ()
    if kept_eval or eval_files:
        splits["eval"] = (*kept_eval, *eval_files)
    manifest = checked(directory, Manifest(
        schema=schema, splits=splits,
        info=info if info is not None else (previous.info if previous else {}),
        windows=(*old_windows, *windows)))  # the checks every reader makes, before publishing
    write_manifest(directory, manifest)
    return manifest
