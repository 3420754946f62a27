"""Retention: which complete checkpoints a run keeps (the most recent ones, the best by
:data:`BEST_BY`, and those it must not lose), and the deletion of the others."""
from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Iterable

from gem_core.checkpoint.layout import complete_checkpoints, read_info

BEST_BY = "mean evaluation NE over tasks"
"""What "best" means for retention (lower is better)."""


def best_checkpoint(run_dir: Path) -> tuple[int, float] | None:
    """``(step, NE)`` of the complete checkpoint with the lowest recorded NE, if any has one."""
    scored = [(info["ne"], step) for step, path in complete_checkpoints(run_dir)
              if isinstance((info := read_info(path)).get("ne"), (int, float))
              and math.isfinite(info["ne"])]
    if not scored:
        return None
    ne, step = min(scored)
    return step, ne


def retain(run_dir: Path, *, keep_last: int, keep_best: bool,
           protect: Iterable[int] = ()) -> list[int]:
    """Delete complete checkpoints except the ``keep_last`` most recent, with ``keep_best`` the
    one with the best NE, and the steps in ``protect`` (the newest verified checkpoint: newer
    ones may be damaged). Returns the steps kept."""
    found = complete_checkpoints(run_dir)
    keep = {step for step, _ in found[-keep_last:]} | set(protect)
    best = best_checkpoint(run_dir) if keep_best else None
    if best is not None:
        keep.add(best[0])
    for step, path in found:
        if step not in keep:
            shutil.rmtree(path)
    return sorted(step for step, _ in found if step in keep)
