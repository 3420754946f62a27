"""``gem train``: train a preset or config file into a run directory."""

from __future__ import annotations

import faulthandler
import json
import os
import time
from pathlib import Path
from typing import Callable

import attrs
import click

from gem_core.cli.launch import Launch, check_launch, run_torchrun, train_arguments
from gem_core.cli.options import config_options
from gem_core.config import load_config
from gem_core.kinds import KIND_TABLE

# Command-line shortcuts for the kinds' config keys (from the table of kinds); each is the same as
# --set KEY=VALUE.
SHORTCUTS = {kind.cli_parameter: kind.config_key for kind in KIND_TABLE if kind.cli_flag}


def backend_options(command: Callable) -> Callable:
    """One ``--<kind>`` option per kind of the table that has a CLI flag, in the table's order."""
    for kind in reversed(KIND_TABLE):
        if kind.cli_flag:
            command = click.option(kind.cli_flag, kind.cli_parameter, default=None,
                                   help=kind.cli_help)(command)
    return command


@click.command("train")
@config_options()
@backend_options
@click.option("--nproc-per-node", default=1, show_default=True, type=click.IntRange(min=1),
              help="Ranks to launch on this node through torchrun (gloo on CPU, nccl on GPU).")
@click.option("--nnodes", default=1, show_default=True, type=click.IntRange(min=1),
              help="Nodes of the run: run the same command on each (one torchrun agent per "
                   "node); they meet at --rdzv-endpoint.")
@click.option("--rdzv-endpoint", default=None, metavar="HOST:PORT",
              help="With --nnodes N: torchrun's c10d rendezvous, a free port on a host every "
                   "node reaches (usually the first node); the agent on HOST serves it.")
@click.option("--rdzv-timeout", "rdzv_timeout_s", default=600, show_default=True,
              type=click.IntRange(min=1),
              help="With --nnodes N: seconds to wait for every node to join and for the "
                   "endpoint to answer before failing.")
@click.option("--max-restarts", default=0, show_default=True, type=click.IntRange(min=0),
              help="With --nproc-per-node or --nnodes: times torchrun restarts a failed group.")
@click.option("--out", "out", default=None, type=click.Path(file_okay=False),
              help="Run directory (default: runs/<preset>-<time>). Resumes from its latest "
                   "complete checkpoint.")
@click.option("--until-step", default=None, type=click.IntRange(min=1),
              help="Stop after this step (checkpointed) without changing the schedule of "
                   "train.steps; run again to continue.")
@click.option("--fresh", is_flag=True,
              help="Start over in --out: delete its checkpoints, logs, summary and TensorBoard "
                   "events first.")
@click.option("--allow-data-change", is_flag=True,
              help="Resume even though the data differs from the checkpoint's (another "
                   "train.seed, [data] section or a data set rewritten in place); refused "
                   "otherwise.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def train(preset, config_file, overrides, nproc_per_node, nnodes, rdzv_endpoint, rdzv_timeout_s,
          max_restarts, out, until_step, fresh, allow_data_change, no_progress,
          **backend_choices) -> None:
    """Train a GEM model. With no options: the default preset on generated data on CPU."""
    launch = Launch(nproc_per_node=nproc_per_node, nnodes=nnodes, rdzv_endpoint=rdzv_endpoint,
                    rdzv_timeout_s=rdzv_timeout_s, max_restarts=max_restarts)
    check_launch(launch)
    all_overrides = list(overrides) + [f"{SHORTCUTS[k]}={v}" for k, v in backend_choices.items()
                                       if v]
    config = load_config(preset=preset, path=config_file, overrides=all_overrides)
    if out is None:
        out = str(Path("runs") / f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir = Path(out).resolve()

    if launch.needs_torchrun and "WORLD_SIZE" not in os.environ:
        run_torchrun(attrs.evolve(launch, stop_grace_s=config.train.stop_grace_s),
                     train_arguments(run_dir=run_dir, preset=preset, config_file=config_file,
                                     overrides=all_overrides, fresh=fresh, until_step=until_step,
                                     allow_data_change=allow_data_change), run_dir=run_dir)
        return  # rank 0 of the launched group printed the result

    from gem_core.cli.main import CATALOG
    from gem_core.process_life import rank_dies_with_agent
    from gem_core.rank_exit import is_process_group_rank
    from gem_core.train.stop_signal import RunStopped
    from gem_core.train.trainer import train as run_training

    rank_dies_with_agent()  # a rank of torchrun's: SIGTERM when the agent dies
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # A rank that dies of a signal inside torch (SIGSEGV in a collective, SIGABRT) would
        # leave only torchrun's "exitcode -11"; this prints every thread's Python stack first.
        faulthandler.enable(all_threads=True)
    try:
        result = run_training(config, CATALOG.plugins, run_dir, fresh=fresh,
                              progress=not no_progress, until_step=until_step,
                              allow_data_change=allow_data_change)
    except RunStopped as stopped:  # with the signal's status (143, 130)
        if is_process_group_rank():  # rank 0 logged it; the launcher says it last
            raise SystemExit(stopped.exit_code) from None
        error = click.ClickException(str(stopped))
        error.exit_code = stopped.exit_code
        raise error from None
    if int(os.environ.get("RANK", "0")) == 0:
        _print_result(result.run_dir)


def _figure(value: float | None) -> str:
    """NE and AUC are undefined (null in summary.json) when an eval set has one class only."""
    return "n/a (one class in the eval set)" if value is None else f"{value:.4f}"


def _print_result(run_dir: Path) -> None:
    summary = json.loads((run_dir / "summary.json").read_text())
    tasks = ", ".join(
        f"{task} NE {_figure(values['ne'])} AUC {_figure(values['auc'])}"
        + (f" GAUC {_figure(values['gauc'])}" if values.get("gauc_users") else "")
        for task, values in summary["eval"].items())
    throughput = summary["throughput"]
    speed = throughput["samples_per_s"]
    requests = throughput.get("requests_per_s")
    click.echo(f"run directory: {run_dir}")
    stopped = summary["run"].get("stopped") or {}
    if stopped.get("reason") in ("epochs", "early_stopping"):
        click.echo(stopped["message"])
    for warning in summary.get("warnings", ()):
        click.echo(f"warning: {warning}")
    used = summary.get("checkpoint_used")
    if "eval_validation" in summary:  # train.validation_share: not the whole eval split
        tasks += " (the users outside the validation part, which chose the checkpoint)"
    progressive = summary.get("progressive")
    if progressive is not None:  # time order: the headline is the windows' mean
        evaluated = len(progressive["windows"])
        tasks = (f"progressive (mean over {evaluated} window"
                 f"{'s' if evaluated != 1 else ''}, each before training on it): {tasks}"
                 if evaluated else "no window evaluated yet (the first is only trained on)")
        click.echo(f"windows trained: {progressive['windows_trained']} of "
                   f"{progressive['windows_total']}")
    click.echo(f"steps {summary['run']['steps']}: {tasks}"
               + (f"; {speed:.0f} impressions/s" if speed is not None else "")
               + (f" ({requests:.0f} requests/s)" if requests is not None else ""))
    if used is not None:  # the figures above are this checkpoint's evaluation
        click.echo(f"checkpoint used by export-model, score, distill and "
                   f"export-user-embeddings: step {used['step']}: {used['reason']}")
