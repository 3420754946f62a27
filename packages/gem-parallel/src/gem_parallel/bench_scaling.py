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
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import click


def run_one(world: int, *, preset: str, per_rank_batch: int, steps: int, sharding: str,
            overrides: Sequence[str], workdir: Path, timeout_s: float) -> dict[str, Any]:
    out = workdir / f"ranks-{world}"
    command = [
        sys.executable, "-m", "gem_core.cli.main", "train", "--preset", preset,
        "--out", str(out), "--fresh", "--no-progress", "--nproc-per-node", str(world),
        "--set", f"train.batch_size={per_rank_batch * world}", "--set", f"train.steps={steps}",
        "--set", "train.eval_every=0", "--set", "train.checkpoint_every=0",
        "--set", "data.eval_rows=64", *(x for o in overrides for x in ("--set", o)),
    ]
    if world > 1:
        command += ["--sharding", sharding]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise click.ClickException(
            f"gem train with {world} ranks failed ({done.returncode}):\n{done.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    throughput, mfu = summary["throughput"], summary["mfu"]
    return {
        "ranks": world,
        "global_batch": per_rank_batch * world,
        "step_time_s_median": throughput["step_time_s_median"],
        "samples_per_s": throughput["samples_per_s"],
        "tokens_per_s": throughput["tokens_per_s"],
        "steps_timed": throughput["steps_timed"],
        "local_mfu": mfu["local"],
    }


def measure_scaling(*, worlds: Sequence[int], preset: str, per_rank_batch: int, steps: int,
                    sharding: str, overrides: Sequence[str], timeout_s: float
                    ) -> dict[str, Any]:
    if 1 not in worlds:
        worlds = (1, *worlds)
    with tempfile.TemporaryDirectory(prefix="gem-scaling-") as tmp:
        runs = [run_one(w, preset=preset, per_rank_batch=per_rank_batch, steps=steps,
                        sharding=sharding, overrides=overrides, workdir=Path(tmp),
                        timeout_s=timeout_s) for w in sorted(set(worlds))]
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
@click.option("--preset", default="tiny", show_default=True)
@click.option("--ranks", "worlds", multiple=True, type=click.IntRange(min=1),
              default=(1, 2, 4), show_default=True, help="World sizes (repeatable).")
@click.option("--per-rank-batch", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--steps", default=12, show_default=True, type=click.IntRange(min=4),
              help="Steps per run (the first 3 are not timed).")
@click.option("--sharding", default="ddp", show_default=True,
              help="Dense sharding strategy of the multi-rank runs.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Config override for every run (repeatable).")
@click.option("--timeout", "timeout_s", default=900.0, show_default=True,
              help="Seconds allowed per run.")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def scaling(preset: str, worlds: tuple[int, ...], per_rank_batch: int, steps: int,
            sharding: str, overrides: tuple[str, ...], timeout_s: float, as_json: bool) -> None:
    """Scaling ratio and E2E MFU of gem train on 1, 2 and 4 CPU ranks (weak scaling)."""
    report = measure_scaling(worlds=worlds, preset=preset, per_rank_batch=per_rank_batch,
                             steps=steps, sharding=sharding, overrides=overrides,
                             timeout_s=timeout_s)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"{preset}, {per_rank_batch} samples per rank, {sharding}, "
               f"{report['cpu_cores']} cores, 1 thread per rank")
    for run in report["runs"]:
        mfu = (f"local MFU {run['local_mfu']:.2%}, E2E {run['e2e_mfu']:.2%}"
               if run["local_mfu"] is not None else "")
        click.echo(f"  {run['ranks']} ranks: {run['samples_per_s']:8.1f} samples/s, scaling "
                   f"ratio {run['scaling_ratio']:.2f}  {mfu}")
