"""An export directory written whole or not at all.

``gem export-model`` writes into a staging directory beside the target
(``.<name>.staging-<pid>``), fsyncs it, and publishes it with one rename: onto a missing target,
or exchanged with an existing export (``renameat2(RENAME_EXCHANGE)``, one atomic step; where the
filesystem lacks it, the old export is renamed aside first, then removed). A ``kill -9`` at any
moment leaves the old export whole, or the new one: never a new program beside an old manifest.
A failed export removes its staging directory; one a killed export left is removed by the next
export to the same target (which also puts back an old export a kill left set aside). A target
that exists and is neither empty nor an export is refused, not replaced.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import shutil
from pathlib import Path
from typing import Iterator

from gem_core.checkpoint.layout import fsync_path
from gem_core.errors import GemConfigError
from gem_core.serving.integrity import MANIFEST

_STAGING = ".staging-"
_ASIDE = ".replaced-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _leftovers(target: Path) -> Iterator[Path]:
    """Staging and set-aside directories of ``target`` whose export process is gone."""
    for kind in (_STAGING, _ASIDE):
        for path in target.parent.glob(f".{glob.escape(target.name)}{kind}*"):
            pid = path.name.rpartition("-")[2]
            if path.is_dir() and not (pid.isdigit() and _alive(int(pid))):
                yield path


def check_target(target: Path) -> None:
    """Refuse a ``target`` that an export may not replace: a file, or a directory that holds
    something else than an export."""
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise GemConfigError(f"{target} exists and is not a directory; choose another --out")
    if target.is_dir() and any(target.iterdir()) and not (target / MANIFEST).is_file():
        raise GemConfigError(f"{target} is a directory that holds no export ({MANIFEST}); an "
                             "export replaces its --out whole: choose an empty or new "
                             "directory, or an earlier export")


def prepare_staging(target: Path) -> Path:
    """An empty staging directory beside ``target`` (after removing what killed exports to the
    same target left); refuses a ``target`` that is not an export directory to replace."""
    target = Path(target)
    check_target(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    for path in _leftovers(target):
        if _ASIDE in path.name and not target.exists():
            os.rename(path, target)  # killed between the two renames: the old export back
        else:
            shutil.rmtree(path, ignore_errors=True)
    staging = target.parent / f".{target.name}{_STAGING}{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories in one step (Linux ``renameat2``); False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def publish(staging: Path, target: Path) -> None:
    """Make the finished ``staging`` directory ``target``, replacing an export there."""
    staging, target = Path(staging), Path(target)
    for path in staging.rglob("*"):
        if path.is_file():
            fsync_path(path)
    fsync_path(staging)
    if not target.exists():
        os.rename(staging, target)
    elif _exchange(staging, target):
        shutil.rmtree(staging)  # it holds the old export now
    else:
        aside = target.parent / f".{target.name}{_ASIDE}{os.getpid()}"
        os.rename(target, aside)
        os.rename(staging, target)
        shutil.rmtree(aside)
    fsync_path(target.parent)


@contextlib.contextmanager
def staged(target: Path) -> Iterator[Path]:
    """A staging directory for ``target``, published when the block ends normally and removed
    when it raises."""
    target = Path(target)
    if target.is_symlink():  # replace the directory the link names, and keep the link
        target = target.resolve()
    staging = prepare_staging(target)
    try:
        yield staging
    except BaseException:  # any failure or interrupt: drop the staging copy, re-raise as is
        shutil.rmtree(staging, ignore_errors=True)
        raise
    publish(staging, target)
