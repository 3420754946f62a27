"""Several training runs one after another in one torchrun world.

Tests that compare strategies on the same ranks (ddp against ep, a stopped run and its resumption)
would otherwise start torchrun and its ranks once per run; on CPU, starting them (importing torch
and the plugins) costs more than a short run itself. Here every rank trains the listed runs in
order::

    python -m torch.distributed.run --standalone --nproc-per-node N \\
        -m gem_core.testing.sequential_runs RUNS.json

``RUNS.json`` is a list of runs, each ``{"out": RUN_DIR, "preset": NAME, "overrides":
["key=value", ...], "until_step": N or null}``: what ``gem train --preset NAME --set key=value
... --until-step N --out RUN_DIR`` would run on those ranks. A failing run ends the script.

Each run gets a process group started here, which the trainer adopts and destroys at its end.
Every group rendezvouses under a prefix of its own in the launcher's store: a finished group's
published addresses stay there and would send the next group's ranks to closed sockets.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

from gem_core.config import load_config
from gem_core.logs import configure_logging
from gem_core.plugins import build_plugins
from gem_core.train.trainer import train

_TIMEOUT = datetime.timedelta(minutes=10)


def _launcher_store(rank: int, world_size: int) -> dist.Store:
    """The torchrun agent's store (or, started some other way, one rank 0 serves)."""
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                         is_master=(rank == 0 and not agent_hosts_store), timeout=_TIMEOUT)


def _check_runs(runs: Any, path: Path) -> list[dict[str, Any]]:
    if not isinstance(runs, list) or not runs:
        raise ValueError(f"{path}: expected a non-empty JSON list of runs, got {runs!r}")
    for index, run in enumerate(runs):
        unknown = set(run) - {"out", "preset", "overrides", "until_step"}
        if "out" not in run or "preset" not in run or unknown:
            raise ValueError(f"{path}: run {index} needs 'out' and 'preset' (and may have "
                             f"'overrides', 'until_step'); got keys {sorted(run)}")
    return runs


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python -m gem_core.testing.sequential_runs RUNS.json")
    path = Path(argv[0])
    runs = _check_runs(json.loads(path.read_text()), path)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    configure_logging("INFO", "text", rank)  # "resumed from ..." lines, as gem train prints
    store = _launcher_store(rank, world_size)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    plugins = build_plugins()
    for index, run in enumerate(runs):
        config = load_config(preset=run["preset"], overrides=list(run.get("overrides", ())))
        dist.init_process_group("gloo", store=dist.PrefixStore(
            f"gem-sequential/attempt-{attempt}/run-{index}", store), rank=rank,
            world_size=world_size, timeout=_TIMEOUT)
        train(config, plugins, Path(run["out"]), progress=False, until_step=run.get("until_step"))
        if dist.is_initialized():
            raise RuntimeError(f"run {index} ({run['out']}) left its process group alive; the "
                               "trainer destroys it at the end of every run")


if __name__ == "__main__":
    main(sys.argv[1:])
