"""Errors of the machine a run writes to, turned into messages that name the cause and the path:
a full disk, a read-only or unwritable run directory (probed before training, not found at the
first save after the work is done)."""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Collection, Iterator

from torch.distributed.checkpoint import CheckpointException

from gem_core.errors import GemRunError

#: Errors that only a write raises: what a whole run is wrapped in (a read-side EACCES, of a
#: data file say, keeps its own message).
WRITE_ONLY_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)

#: OSError numbers that mean "this location cannot be written", with what to tell the user.
_WRITE_ERRORS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}

PROBE_NAME = ".gem-write-probe"


def _os_errors(error: BaseException) -> Iterator[OSError]:
    """``error`` and what it wraps: its cause and context chain, and the per-rank failures a
    ``torch.distributed.checkpoint`` exception carries (a write error inside DCP's writer
    arrives as a ``CheckpointException``)."""
    seen: set[int] = set()
    pending: list[BaseException] = [error]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError):
            yield current
        if isinstance(current, CheckpointException):
            pending.extend(failure[0] for failure in current.failures.values())
        pending.extend(e for e in (current.__cause__, current.__context__) if e is not None)


def describe_write_error(error: BaseException, what: str, path: Path, *,
                         errnos: Collection[int] = tuple(_WRITE_ERRORS)) -> str | None:
    """One sentence for a failed write of ``what`` under ``path``, or None when ``error`` is
    not one of the "cannot write here" errors in ``errnos`` (those keep their traceback)."""
    for os_error in _os_errors(error):
        cause = _WRITE_ERRORS.get(os_error.errno)
        if cause is not None and os_error.errno in errnos:
            where = os_error.filename or path
            advice = ("free space (or point --out at another disk) and run the same command "
                      "again: it resumes from the latest complete checkpoint"
                      if os_error.errno in (errno.ENOSPC, errno.EDQUOT) else
                      "make it writable or choose another --out")
            return (f"cannot write {what}: {cause} ({errno.errorcode[os_error.errno]}) at "
                    f"{where}; {advice}")
    return None


@contextlib.contextmanager
def write_errors_named(what: str, path: Path, *,
                       errnos: Collection[int] = tuple(_WRITE_ERRORS)) -> Iterator[None]:
    """Turn a disk-full, read-only or permission error (of ``errnos``) raised while writing
    ``what`` (also from inside DCP's writer) into a :class:`GemRunError` naming the cause and
    the path."""
    try:
        yield
    except (OSError, CheckpointException) as error:
        message = describe_write_error(error, what, path, errnos=errnos)
        if message is None:
            raise
        raise GemRunError(message) from error


def probe_writable(directory: Path, what: str) -> None:
    """Create, write, fsync and remove a small file in ``directory`` (created if missing), so
    that a read-only or unwritable location stops the run at start-up with its path named."""
    probe = directory / PROBE_NAME
    with write_errors_named(what, probe):  # os.write's errors carry no file name: name the probe
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as error:
            raise GemRunError(f"cannot write {what}: {error.filename or directory} is not a "
                              "directory; remove it or choose another --out") from None
        handle = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(handle, b"probe\n")
            os.fsync(handle)
        finally:
            os.close(handle)
        probe.unlink()


def probe_run_directory(run_dir: Path) -> None:
    """Rank 0, holding the run's lock, before training: every place the run will write.
    Existing files that are appended to or rewritten must be writable too."""
    probe_writable(run_dir, "the run directory")
    probe_writable(run_dir / "checkpoints", "checkpoints")
    if (run_dir / "tensorboard").exists():
        probe_writable(run_dir / "tensorboard", "TensorBoard events")
    for name in ("metrics.jsonl", "eval.jsonl", "config.toml"):
        existing = run_dir / name
        if existing.exists():
            with write_errors_named(name, existing):
                with open(existing, "a"):
                    pass
