"""The on-disk protocol of checkpoints in ``RUN_DIR/checkpoints/``: layout, atomic publish,
digests, recovery of interrupted saves. What goes into a checkpoint is
:mod:`gem_core.checkpoint.checkpointer`'s business; how its files are read without running code
from them, :mod:`gem_core.checkpoint.io`'s; which ones are kept,
:mod:`gem_core.checkpoint.retention`'s.

A checkpoint of step N is written into ``.tmp-step-NNNNNNNN`` (the same name on every rank, so
all ranks write their shards into one directory), then rank 0 records the digests, adds the
``COMPLETE`` marker and publishes it with one rename to ``step-NNNNNNNN``. A process killed
mid-save leaves only a temporary directory: without the marker it is never loaded and the next
run removes it; with the marker (killed between marker and rename) the save was finished and the
next run publishes it. Layout of a published checkpoint::

    step-00000040/
        COMPLETE        the marker (written last, before the rename)
        digests.json    size and SHA-256 of every other file, checked before anything loads
        info.json       step, format and evaluation NE (read by retention)
        trainer.json    trainer state written by rank 0 (step, data positions, counters, guard,
                        config, world size, dense strategy), plain JSON, and beside it
        trainer-tensors.pt  its tensors (RNG states), loaded with weights_only=True
        engine/         model + optimizer through torch.distributed.checkpoint (each rank
                        writes its own shards; any number of ranks can load them), or
        engine.pt       the full model + optimizer state of engines that keep a full-state
                        format (DeepSpeed ZeRO), written by rank 0, and beside it
        sharded/        with such engines, the sharded modules' state (TorchRec tables and
                        their sparse optimizer) through DCP, every rank its own shards
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from gem_core.checkpoint.digests import write_digests

log = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
INFO_FILE = "info.json"
TRAINER_FILE = "trainer.json"
TRAINER_TENSORS_FILE = "trainer-tensors.pt"
LEGACY_TRAINER_FILE = "trainer.pt"
"""The side file of older versions: a pickle, which this version refuses to load."""
ENGINE_DIR = "engine"
FULL_ENGINE_FILE = "engine.pt"
SHARDED_DIR = "sharded"
PREFIX = "step-"
TEMPORARY_PREFIX = ".tmp-"
REPLACED_PREFIX = ".replaced-"
"""Where a published checkpoint waits while a new save of the same step takes its place."""

def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


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


def staging_dir(run_dir: Path, step: int) -> Path:
    """Where every rank writes the checkpoint of ``step`` before it is published."""
    return checkpoint_dir(run_dir) / f"{TEMPORARY_PREFIX}{_name(step)}"


def prepare_staging(run_dir: Path, step: int) -> Path:
    """Rank 0, before any rank writes: an empty staging directory for ``step``."""
    staging = staging_dir(run_dir, step)
    staging.parent.mkdir(parents=True, exist_ok=True)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    return staging


def write_info(staging: Path, *, step: int, format: str, ne: float | None,
               ne_of: str = "eval") -> None:
    """``info.json``: the step, the engine's format and the NE checkpoints are ranked by, with
    the part of the evaluation it is of (``ne_of``: ``eval``, or ``validation`` under
    ``train.validation_share``)."""
    (staging / INFO_FILE).write_text(json.dumps({"step": step, "format": format, "ne": ne,
                                                 "ne_of": ne_of}))


def read_info(path: Path) -> dict[str, Any]:
    info = path / INFO_FILE
    return json.loads(info.read_text()) if info.exists() else {}


def publish(run_dir: Path, step: int) -> Path:
    """Rank 0, after every rank finished writing into the staging directory: record the
    digests, mark it complete (durably) and rename it into place."""
    staging = staging_dir(run_dir, step)
    write_digests(staging)
    for path in staging.rglob("*"):
        if path.is_file():
            fsync_path(path)
    marker = staging / COMPLETE
    marker.write_text(f"{step}\n")
    fsync_path(marker)
    fsync_path(staging)
    return _move_into_place(staging, checkpoint_dir(run_dir) / _name(step))


def _move_into_place(staging: Path, final: Path) -> Path:
    """Rename a complete staging directory to ``final``. Re-saving a published step (e.g. the
    final step of a resumed run) sets the old copy aside first and deletes it only once the new
    one is in place, so a complete copy exists at every moment."""
    if final.exists():
        aside = final.parent / f"{REPLACED_PREFIX}{final.name}"
        if aside.exists():  # left by an earlier replacement that finished its renames
            shutil.rmtree(aside)
        os.replace(final, aside)
        os.replace(staging, final)
        fsync_path(final.parent)
        shutil.rmtree(aside)
    else:
        os.replace(staging, final)
    fsync_path(final.parent)
    return final


def remove_torn(run_dir: Path) -> list[Path]:
    """Rank 0, when no save is in flight (at start): finish what an interrupted run left.

    A staging directory with the ``COMPLETE`` marker is a finished save killed before its
    rename: it is published (logged). A copy set aside by an interrupted re-save is restored
    when nothing replaced it, else deleted. Staging directories without the marker are saves
    that never finished: they are deleted and returned."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    for staging in sorted(root.iterdir()):
        if staging.name.startswith(TEMPORARY_PREFIX) and (staging / COMPLETE).is_file():
            final = _move_into_place(staging, root / staging.name[len(TEMPORARY_PREFIX):])
            log.warning("published %s: its save had finished (COMPLETE) but was stopped before "
                        "the rename", final)
    for aside in sorted(root.iterdir()):
        if aside.name.startswith(REPLACED_PREFIX):
            final = root / aside.name[len(REPLACED_PREFIX):]
            if final.exists():
                shutil.rmtree(aside)
            else:
                os.replace(aside, final)
                fsync_path(root)
                log.warning("restored %s: a re-save of that step was stopped before its new "
                            "copy was complete", final)
    torn = [p for p in sorted(root.iterdir()) if p.name.startswith(TEMPORARY_PREFIX)]
    for path in torn:
        shutil.rmtree(path)
    return torn


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's contents (a directory's: its entries, so a rename into
    it survives a crash) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
