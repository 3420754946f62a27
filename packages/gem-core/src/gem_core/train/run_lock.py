"""One trainer per run directory.

Rank 0 takes an exclusive ``fcntl.flock`` on ``RUN_DIR/.gem-train.lock`` before anything in the
directory is touched (``--fresh`` deletion, torn-staging cleanup, logs) and holds it for the
run's life; the kernel releases it when the process exits, however it exits, so a lock left by
a dead trainer is simply taken over (and its holder details rewritten). The file's content names
the holder (pid, host, start time, command) for the refusal message of a second trainer.

Every rank of a multi-rank run learns rank 0's verdict through a broadcast, so all ranks start
or all stop. Ranks on other hosts do not take the lock themselves: ``flock`` on one host does
not see a lock held on another unless the file system forwards it (Linux NFS clients map
``flock`` to POSIX byte-range locks since 2.6.12; many FUSE and object-store mounts keep locks
local), so two runs whose rank 0 sit on different hosts of such a file system are not kept
apart.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Iterator

from gem_core.distributed import ParallelContext
from gem_core.errors import GemRunError
from gem_core.train.environment import probe_run_directory, write_errors_named

LOCK_NAME = ".gem-train.lock"

#: How long a refused trainer waits for the holder's details when the holder has just taken the
#: lock and not yet written them.
HOLDER_WAIT_S = 1.0


class RunLock:
    """An exclusive lock on a run directory, held by this process until :meth:`release`."""

    def __init__(self, path: Path, descriptor: int) -> None:
        self.path = path
        self._descriptor: int | None = descriptor

    @classmethod
    def acquire(cls, run_dir: Path) -> RunLock:
        """Create ``run_dir`` if needed and lock it; :class:`GemRunError` naming the holder when
        another trainer holds it, or naming the path when the directory cannot be written."""
        run_dir = Path(run_dir)
        with write_errors_named("the run directory", run_dir):
            try:
                run_dir.mkdir(parents=True, exist_ok=True)
            except (FileExistsError, NotADirectoryError):
                raise GemRunError(f"cannot use {run_dir} as the run directory (--out): it or a "
                                  "folder above it is a file") from None
            path = run_dir / LOCK_NAME
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            raise GemRunError(
                f"{run_dir} is in use by another trainer ({_describe_holder(path)}); two "
                "trainers in one run directory would overwrite each other's checkpoints and "
                "logs. Wait for it to finish, stop it, or choose another --out") from None
        lock = cls(path, descriptor)
        lock._write_holder()
        return lock

    def _write_holder(self) -> None:
        """Replace the previous holder's details (a stale lock keeps them) with this process'."""
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": datetime.datetime.now(datetime.timezone.utc).isoformat(
                      timespec="seconds"),
                  "command": " ".join(sys.argv)[:500]}
        data = (json.dumps(holder) + "\n").encode()
        with write_errors_named("the run directory's lock file", self.path):
            os.ftruncate(self._descriptor, 0)
            os.pwrite(self._descriptor, data, 0)
            os.fsync(self._descriptor)

    def release(self) -> None:
        """Unlock (the file stays: deleting it could let two trainers lock two different files
        of the same name)."""
        if self._descriptor is not None:
            fcntl.flock(self._descriptor, fcntl.LOCK_UN)
            os.close(self._descriptor)
            self._descriptor = None


def _describe_holder(path: Path) -> str:
    """``pid 123 on host h, started ...`` from the lock file, waiting briefly for a holder that
    has just taken the lock to write its details."""
    deadline = time.monotonic() + HOLDER_WAIT_S
    while True:
        try:
            holder = json.loads(path.read_text())
            return (f"pid {holder['pid']} on host {holder['host']}, started {holder['started']}: "
                    f"{holder['command']}")
        except (OSError, ValueError, KeyError, TypeError):
            if time.monotonic() > deadline:
                return f"holder details unreadable in {path}"
            time.sleep(0.05)


@contextlib.contextmanager
def hold_run_directory(run_dir: Path, ctx: ParallelContext) -> Iterator[None]:
    """Rank 0 locks ``run_dir`` and probes that the run can write there; every rank gets its
    verdict (all start, or all raise the same :class:`GemRunError`). Released on exit."""
    lock, refusal = None, None
    if ctx.is_main:
        try:
            lock = RunLock.acquire(run_dir)
            probe_run_directory(Path(run_dir))
        except Exception as error:  # any failure: the other ranks must hear of it, not hang
            refusal = error
    if ctx.is_distributed:
        import torch.distributed as dist

        verdict = [None if refusal is None else str(refusal)]
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None and refusal is None:
            refusal = GemRunError(f"rank 0 refused the run: {verdict[0]}")
    try:
        if refusal is not None:
            raise refusal
        yield
    finally:
        if lock is not None:
            lock.release()
