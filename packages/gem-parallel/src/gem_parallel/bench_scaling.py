"""``gem bench scaling``: the scaling ratio that turns local MFU into end-to-end MFU.

Weak scaling, as data-parallel training runs: every rank keeps the same per-rank batch, so N
ranks train on an N-times larger global batch. Each world size is a real ``gem train
--nproc-per-node N`` run (torchrun, gloo on CPU) of a short job; its median step time (first
steps excluded, as in ``summary.json``) gives samples per second, and

    scaling ratio(N) = throughput(N) / (N x throughput(1))
    E2E MFU(N) = local MFU(N) x scaling ratio(N)

Every rank gets one thread (``OMP_NUM_THREADS=1``, also for the single-rank run), so the ratio
measures the distributed overhead (collectives, stragglers, launch) rather than how a process
with all cores compares to N processes sharing them. On a machine with fewer cores than ranks
the ranks time-share cores and the ratio shows that too; the report records the core count.

With ``--nnodes N`` the largest ``--ranks`` also runs as N "nodes" on this machine: N torchrun
agents (``gem train --nnodes N --rdzv-endpoint 127.0.0.1:PORT``) meeting at a c10d rendezvous,
each starting its ranks, as N machines would; the collectives then cross the node boundary the
way the run's strategies place them (HSDP replicas, TorchRec's node-aware sharding types), but
over loopback and the same cores, so the figure is the overhead of the layout, not of a network.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import click

from gem_core.cli.options import config_options
from gem_core.testing.processes import run_process_group
from gem_core.train.summary import WARMUP_STEPS_EXCLUDED
from gem_parallel.bench_train import bench_train_command


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_one(world: int, *, preset: str, per_rank_batch: int, steps: int, sharding: str,
            overrides: Sequence[str], workdir: Path, timeout_s: float,
            nodes: int = 1) -> dict[str, Any]:
    """One ``gem train`` of ``world`` ranks, on ``nodes`` agents of ``world / nodes`` ranks."""
    per_node = world // nodes
    out = workdir / f"nodes-{nodes}-ranks-{world}"
    command = bench_train_command(preset=preset, out=out, ranks_per_node=per_node, world=world,
                                  per_rank_batch=per_rank_batch, steps=steps, sharding=sharding,
                                  overrides=overrides)
    if nodes > 1:
        command += ["--nnodes", str(nodes), "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
                    "--rdzv-timeout", str(int(timeout_s))]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # One agent per node, started together (as srun starts one per machine).
    with ThreadPoolExecutor(nodes) as pool:
        results = list(pool.map(lambda _: run_process_group(command, timeout=timeout_s, env=env),
                                range(nodes)))
    for node, done in enumerate(results):
        if done.returncode != 0:
            raise click.ClickException(
                f"gem train with {nodes} node(s) x {per_node} ranks failed on agent {node} "
                f"({done.returncode}):\n{done.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    throughput, mfu = summary["throughput"], summary["mfu"]
    return {
        "ranks": world,
        "nodes": nodes,
        "ranks_per_node": per_node,
        "global_batch": per_rank_batch * world,
        "step_time_s_median": throughput["step_time_s_median"],
        "samples_per_s": throughput["samples_per_s"],
        "tokens_per_s": throughput["tokens_per_s"],
        "steps_timed": throughput["steps_timed"],
        "local_mfu": mfu["local"],
    }


def layouts(worlds: Sequence[int], nnodes: int) -> list[tuple[int, int]]:
    """``(nodes, ranks)`` to run: one node with each of ``worlds`` ranks (and one rank), and
    with ``nnodes > 1`` also ``nnodes`` nodes of the largest number of ranks each."""
    single_node = sorted({1, *worlds})
    runs = [(1, world) for world in single_node]
    if nnodes > 1:
        runs.append((nnodes, nnodes * single_node[-1]))
    return runs


def measure_scaling(*, worlds: Sequence[int], preset: str, per_rank_batch: int, steps: int,
                    sharding: str, overrides: Sequence[str], timeout_s: float,
                    nnodes: int = 1) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gem-scaling-") as tmp:
        runs = [run_one(world, preset=preset, per_rank_batch=per_rank_batch, steps=steps,
                        sharding=sharding, overrides=overrides, workdir=Path(tmp),
                        timeout_s=timeout_s, nodes=nodes)
                for nodes, world in layouts(worlds, nnodes)]
    single = runs[0]["samples_per_s"]
    for run in runs:
        run["scaling_ratio"] = run["samples_per_s"] / (run["ranks"] * single)
        run["e2e_mfu"] = (run["local_mfu"] * run["scaling_ratio"]
                          if run["local_mfu"] is not None else None)
    return {
        "benchmark": "weak scaling of gem train",
        "preset": preset,
        "dense_sharding": sharding,
        "per_rank_batch": per_rank_batch,
        "steps": steps,
        "cpu_cores": os.cpu_count(),
        "threads_per_rank": 1,
        "runs": runs,
    }


@click.command(name="scaling")
@config_options(preset="tiny", preset_help="Preset of every run", config_file=False,
                set_help="Override a key for every run, e.g. --set train.lr=0.01 (repeatable).")
@click.option("--ranks", "worlds", multiple=True, type=click.IntRange(min=1),
              default=(1, 2, 4), show_default=True,
              help="Ranks of one node (repeatable); 1 is always run.")
@click.option("--nnodes", default=1, show_default=True, type=click.IntRange(min=1),
              help="Also run this many nodes (torchrun agents on this machine at a local "
                   "rendezvous) of the largest --ranks each.")
@click.option("--per-rank-batch", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--steps", default=12, show_default=True,
              type=click.IntRange(min=WARMUP_STEPS_EXCLUDED + 1),
              help=f"Steps per run (the first {WARMUP_STEPS_EXCLUDED} are not timed).")
@click.option("--sharding", default="ddp", show_default=True,
              help="Dense sharding strategy of the multi-rank runs.")
@click.option("--timeout", "timeout_s", default=900.0, show_default=True,
              help="Seconds allowed per run.")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def scaling(preset: str, worlds: tuple[int, ...], nnodes: int, per_rank_batch: int, steps: int,
            sharding: str, overrides: tuple[str, ...], timeout_s: float, as_json: bool) -> None:
    """Scaling ratio and E2E MFU of gem train on 1, 2 and 4 CPU ranks (weak scaling); with
    --nnodes N also N nodes x the largest --ranks (e.g. --ranks 2 --nnodes 2: 1x1, 1x2, 2x2)."""
    report = measure_scaling(worlds=worlds, preset=preset, per_rank_batch=per_rank_batch,
                             steps=steps, sharding=sharding, overrides=overrides,
                             timeout_s=timeout_s, nnodes=nnodes)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"{preset}, {per_rank_batch} samples per rank, {sharding}, "
               f"{report['cpu_cores']} cores, 1 thread per rank")
    for run in report["runs"]:
        mfu = (f"local MFU {run['local_mfu']:.2%}, E2E {run['e2e_mfu']:.2%}"
               if run["local_mfu"] is not None else "")
        click.echo(f"  {run['nodes']} node(s) x {run['ranks_per_node']} ranks: "
                   f"{run['samples_per_s']:8.1f} samples/s, scaling ratio "
                   f"{run['scaling_ratio']:.2f}  {mfu}")
    most = max(run["ranks"] for run in report["runs"])
    if most > (report["cpu_cores"] or 1):
        click.echo(f"  note: {most} ranks share {report['cpu_cores']} cores: the ratio includes "
                   "their time-sharing, not only communication")
