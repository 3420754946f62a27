"""``gem bench pipeline``: step time of ``--embedding-sharding torchrec`` runs with and without
TorchRec's train pipelines (``[parallel.embedding] pipeline``).

Each measurement is a real ``gem train`` run (torchrun and gloo on CPU for several ranks) of a
short job, once per pipeline and repeat, the pipelines taking turns within each repeat so that a
change in the machine's load falls on all of them alike. A run's figure is the median over its
steps (the trainer's untimed first steps, ``WARMUP_STEPS_EXCLUDED``, left out) of
``loop_step_time_s``: the step as the training loop sees it, fetching the batch and the
pipeline's work ahead included (the trainer's ``step_time_s`` starts once the batch is in hand,
which would leave out the work a pipeline moves before the step).
The report gives each pipeline's median over the repeats, every run's figure, and the speedup
over ``none`` (its median step time over the pipeline's).

On CPU the overlap has little to hide: gloo's all-to-alls of a small job take a fraction of a
millisecond, and ranks that share cores (2 ranks on 2 cores, with other work) compete with the
communication threads that would overlap the compute; expect ratios near 1 there. The pipelines
earn their keep where the all-to-alls are long: many ranks, large batches, GPUs.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Sequence

import click

from gem_core.cli.options import config_options
from gem_core.train.summary import WARMUP_STEPS_EXCLUDED
from gem_parallel.bench_train import bench_train_command
from gem_parallel.torchrec.plan import PIPELINES


def run_once(pipeline: str, *, ranks: int, preset: str, per_rank_batch: int, steps: int,
             sharding: str, overrides: Sequence[str], out: Path,
             timeout_s: float) -> dict[str, Any]:
    """One ``gem train`` run; its median loop step time and final loss."""
    # train.log_every=1 before the caller's overrides: every step's time is read back below.
    command = bench_train_command(
        preset=preset, out=out, ranks_per_node=ranks, world=ranks, per_rank_batch=per_rank_batch,
        steps=steps, sharding=sharding, overrides=("train.log_every=1", *overrides),
        options=("--embedding-sharding", "torchrec",
                 "--set", f"parallel.embedding.pipeline={pipeline}"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise click.ClickException(f"gem train with pipeline {pipeline!r} on {ranks} rank(s) "
                                   f"failed ({done.returncode}):\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = [r["loop_step_time_s"] for r in records[WARMUP_STEPS_EXCLUDED:]]
    return {"loop_step_time_s_median": statistics.median(timed),
            "step_time_s_median": statistics.median(r["step_time_s"]
                                                    for r in records[WARMUP_STEPS_EXCLUDED:]),
            "final_loss": records[-1]["loss"]}


def measure_pipelines(*, pipelines: Sequence[str], ranks: int, repeats: int, preset: str,
                      per_rank_batch: int, steps: int, sharding: str, overrides: Sequence[str],
                      timeout_s: float) -> dict[str, Any]:
    pipelines = list(dict.fromkeys(["none", *pipelines]))  # "none" is the baseline
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in pipelines}
    with tempfile.TemporaryDirectory(prefix="gem-bench-pipeline-") as tmp:
        for repeat in range(repeats):
            for pipeline in pipelines:
                runs[pipeline].append(run_once(
                    pipeline, ranks=ranks, preset=preset, per_rank_batch=per_rank_batch,
                    steps=steps, sharding=sharding, overrides=overrides,
                    out=Path(tmp) / f"{pipeline}-{repeat}", timeout_s=timeout_s))
    rows = []
    for pipeline in pipelines:
        figures = [r["loop_step_time_s_median"] for r in runs[pipeline]]
        rows.append({"pipeline": pipeline, "step_time_s_median": statistics.median(figures),
                     "step_time_s_runs": figures,
                     "trainer_step_time_s_median": statistics.median(
                         r["step_time_s_median"] for r in runs[pipeline]),
                     "final_loss": [r["final_loss"] for r in runs[pipeline]]})
    baseline = rows[0]["step_time_s_median"]
    for row in rows:
        row["speedup_over_none"] = baseline / row["step_time_s_median"]
    return {"benchmark": "gem train step time with TorchRec's train pipelines",
            "preset": preset, "ranks": ranks, "dense_sharding": sharding if ranks > 1 else None,
            "per_rank_batch": per_rank_batch, "steps": steps,
            "steps_untimed": WARMUP_STEPS_EXCLUDED,
            "repeats": repeats, "cpu_cores": os.cpu_count(), "threads_per_rank": 1,
            "pipelines": rows}


@click.command(name="pipeline")
@config_options(preset="tiny", preset_help="Preset of every run", config_file=False,
                set_help="Override a key for every run, e.g. --set train.lr=0.01 (repeatable).")
@click.option("--ranks", default=2, show_default=True, type=click.IntRange(min=1),
              help="Ranks of every run (1: one process, TorchRec in a group of one rank).")
@click.option("--pipeline", "pipelines", multiple=True, type=click.Choice(PIPELINES),
              default=PIPELINES, show_default=True,
              help="Pipelines to time (repeatable); none, the baseline, always runs.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1),
              help="Runs per pipeline, the pipelines taking turns.")
@click.option("--per-rank-batch", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--steps", default=12, show_default=True,
              type=click.IntRange(min=WARMUP_STEPS_EXCLUDED + 1),
              help=f"Steps per run (the first {WARMUP_STEPS_EXCLUDED} are not timed).")
@click.option("--sharding", default="ddp", show_default=True,
              help="Dense sharding strategy of runs on several ranks.")
@click.option("--timeout", "timeout_s", default=900.0, show_default=True,
              help="Seconds allowed per run.")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def pipeline(preset: str, ranks: int, pipelines: tuple[str, ...], repeats: int,
             per_rank_batch: int, steps: int, sharding: str, overrides: tuple[str, ...],
             timeout_s: float, as_json: bool) -> None:
    """Step time of TorchRec-sharded training with and without TorchRec's train pipelines."""
    report = measure_pipelines(pipelines=pipelines, ranks=ranks, repeats=repeats, preset=preset,
                               per_rank_batch=per_rank_batch, steps=steps, sharding=sharding,
                               overrides=overrides, timeout_s=timeout_s)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"{preset}, {ranks} rank(s), {per_rank_batch} samples per rank, "
               f"{report['cpu_cores']} cores, 1 thread per rank; median of {repeats} run(s) of "
               f"the median loop step time (first {WARMUP_STEPS_EXCLUDED} steps untimed)")
    for row in report["pipelines"]:
        runs = ", ".join(f"{t * 1e3:.1f}" for t in row["step_time_s_runs"])
        click.echo(f"  {row['pipeline']:<12} {row['step_time_s_median'] * 1e3:8.1f} ms/step  "
                   f"speedup {row['speedup_over_none']:.2f}x  (runs: {runs} ms)")
