"""The ``gem train`` run the parallelism benchmarks time: one command line, built in one place."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence


def bench_train_command(*, preset: str, out: Path, ranks_per_node: int, world: int,
                        per_rank_batch: int, steps: int, sharding: str,
                        overrides: Sequence[str] = (), options: Sequence[str] = ()
                        ) -> list[str]:
    """``python -m gem_core.cli.main train`` of ``preset`` into ``out`` (fresh, no progress
    bar) on ``ranks_per_node`` ranks, with a global batch of ``per_rank_batch * world``, no
    evaluation or checkpoint during the timed steps and a small eval split; ``sharding`` is the
    dense strategy when ``world > 1``. ``options`` are more command-line options, ``overrides``
    more ``--set`` values (after the benchmark's own, so they win)."""
    command = [
        sys.executable, "-m", "gem_core.cli.main", "train", "--preset", preset,
        "--out", str(out), "--fresh", "--no-progress", "--nproc-per-node", str(ranks_per_node),
        *options,
        "--set", f"train.batch_size={per_rank_batch * world}", "--set", f"train.steps={steps}",
        "--set", "train.eval_every=0", "--set", "train.checkpoint_every=0",
        "--set", "data.eval_rows=64", *(x for o in overrides for x in ("--set", o)),
    ]
    if world > 1:
        command += ["--sharding", sharding]
    return command
