"""Stopping a run's background threads before its process group is destroyed.

A run has work in other threads: the training stream's prefetch (gem-data's Parquet loader reads
and checks row groups ahead), a background checkpoint (DCP's writer thread, which runs
collectives on the checkpointer's own group), TensorBoard's event writer. Destroying the process
group, or exiting, while one of them is still inside torch, gloo or arrow can kill a run that
has finished. :func:`stop_background_work` stops and joins them, on success and on every error
path, before :func:`gem_core.distributed.shutdown`; it never raises, so the error that ended the
run stays the one reported. (gloo's own C++ worker threads outlive the group's destruction; a
rank of a multi-process run therefore ends without interpreter finalization, see
:mod:`gem_core.rank_exit`.)
"""

from __future__ import annotations

import logging
from typing import Any, Callable

log = logging.getLogger(__name__)


def stop_background_work(trainer: Any | None, *, failed: bool) -> list[str]:
    """Stop and join ``trainer``'s background threads. None (the trainer's construction failed)
    stops nothing: threads start only once the run does (the stream's prefetch at the first
    batch, a background save at the first checkpoint, TensorBoard's writer in ``run``).
    ``failed``: the run is ending with an error, so a background checkpoint is waited for but
    not published (see :meth:`gem_core.checkpoint.checkpointer.Checkpointer.close`). Returns the
    problems met, each also logged."""
    if trainer is None:
        return []
    checkpointer = trainer.checkpointer
    steps: list[tuple[str, Callable[[], None]]] = [
        ("the training stream", trainer.stream.close),
        ("the background checkpoint", lambda: checkpointer.close(publish=not failed)),
        ("the run directory's writers", trainer.run_dir.close),
    ]
    problems = []
    for what, stop in steps:
        try:
            stop()
        except Exception as error:  # noqa: BLE001 - teardown reports and goes on: every thread
            # must still be stopped, and the run's own error (if any) is the one to raise.
            problems.append(f"stopping {what}: {type(error).__name__}: {error}")
            log.warning("while ending the run, stopping %s failed: %s: %s", what,
                        type(error).__name__, error)
    return problems
