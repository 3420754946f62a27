"""Atomic, resumable checkpoints in ``RUN_DIR/checkpoints/step-NNNNNNNN/``.

A checkpoint is written under a temporary name, completed with a ``COMPLETE`` marker and then
published with one rename, so a process killed mid-save leaves the previous checkpoint intact and
the torn one is never loaded (it has no marker and a temporary name).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

COMPLETE = "COMPLETE"
STATE_FILE = "state.pt"
PREFIX = "step-"


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete checkpoint, oldest first."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        name = path.name
        if name.startswith(PREFIX) and name[len(PREFIX):].isdigit() and (path / COMPLETE).exists():
            found.append((int(name[len(PREFIX):]), path))
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write ``state`` for ``step`` atomically and keep only the ``keep`` most recent."""
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:08d}"
    temporary = root / f".tmp-{PREFIX}{step:08d}-{os.getpid()}"
    if temporary.exists():
        shutil.rmtree(temporary)
    temporary.mkdir()
    with open(temporary / STATE_FILE, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    (temporary / COMPLETE).write_text(f"{step}\n")
    if final.exists():  # re-saving the same step (e.g. the final step of a resumed run)
        shutil.rmtree(final)
    os.replace(temporary, final)
    _fsync_dir(root)
    for _, old in complete_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old)
    return final


def load_checkpoint(path: Path) -> dict[str, Any]:
    if not (path / COMPLETE).exists():
        raise RuntimeError(f"checkpoint {path} has no {COMPLETE} marker: it was never finished")
    # weights_only=False: the state holds RNG states and plain Python data written by us.
    return torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
