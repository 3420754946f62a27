"""PNG plots of one run or several overlaid (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from gem_core.report.runs import RunRecord


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    return plt


def _series(records: Sequence[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in points], [p[1] for p in points]


def _ne_series(evals: Sequence[dict], task: str) -> tuple[list[int], list[float]]:
    """The evaluations' NE of ``task`` (entries without a number for it left out)."""
    points = [(e["step"], e[task]["ne"]) for e in evals
              if isinstance(e.get(task), dict) and isinstance(e[task].get("ne"), (int, float))]
    return [p[0] for p in points], [p[1] for p in points]


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


#: The caption of each plot of :func:`run_plots`, by its file name.
PLOT_CAPTIONS = {
    "loss": "Training loss per step, all tasks and each task",
    "ne": "Normalized entropy on the held-out split (below 1 beats the base rate)",
    "throughput": "Throughput: impressions and history tokens per second",
    "mfu": "Local model FLOPs utilisation per step",
    "padding": "Share of padded-to-max FLOPs that jagged batches did not spend",
    "balance": "Per-rank balance: the busiest rank's tokens over the mean",
    "progressive": "Progressive NE over time: each window scored before the model trained on it",
}


def _mark_resume(ax, run: RunRecord) -> None:
    if run.resumed_from:
        ax.axvline(run.resumed_from, color="tab:red", linestyle=":", linewidth=1.5,
                   label=f"resumed from step {run.resumed_from}")


def run_plots(run: RunRecord, out: Path) -> dict[str, Path]:
    """Loss, NE per task, throughput, MFU, padding saved and (with several ranks) per-rank
    balance of one run, as ``{name: png}`` (names are the keys of :data:`PLOT_CAPTIONS`)."""
    plt = _pyplot()
    out.mkdir(parents=True, exist_ok=True)
    plots: dict[str, Path] = {}

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*_series(run.metrics, "loss"), label="all tasks", linewidth=1)
    for task in run.tasks:
        ax.plot(*_series(run.metrics, f"loss_{task}"), label=task, linewidth=1)
    _mark_resume(ax, run)
    ax.set(xlabel="step", ylabel="training loss", title="Loss", yscale="log")
    ax.legend()
    plots["loss"] = _save(fig, out / "loss.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for task in run.tasks:
        ax.plot(*_ne_series(run.evals, task), marker="o", label=task)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="base rate")
    ax.set(xlabel="step", ylabel="normalized entropy", title="NE on the held-out split")
    ax.legend()
    plots["ne"] = _save(fig, out / "ne.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*_series(run.metrics, "samples_per_s"), label="samples/s", linewidth=1)
    twin = ax.twinx()
    twin.plot(*_series(run.metrics, "tokens_per_s"), color="tab:orange", label="tokens/s",
              linewidth=1)
    ax.set(xlabel="step", ylabel="samples/s", title="Throughput")
    twin.set_ylabel("tokens/s")
    plots["throughput"] = _save(fig, out / "throughput.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*_series(run.metrics, "mfu"), linewidth=1)
    ax.set(xlabel="step", ylabel="local MFU", title="Model FLOPs utilisation")
    plots["mfu"] = _save(fig, out / "mfu.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    # The same two shares as the summary table (which gives them over the whole run).
    for spent, padded, label in (("flops", "padded_flops", "all FLOPs"),
                                 ("attention_flops", "padded_attention_flops", "attention")):
        steps, saved = padding_saved_per_step(run.metrics, spent, padded)
        if steps:
            ax.plot(steps, saved, linewidth=1, label=label)
    ax.set(xlabel="step", ylabel="share of padded FLOPs not spent", title="Padding saved",
           ylim=(0, 1))
    ax.legend()
    plots["padding"] = _save(fig, out / "padding.png")

    windowed = [e for e in run.evals if "window" in e]
    if windowed:  # data.order = "time": NE over time, one point per window
        fig, ax = plt.subplots(figsize=(7, 4))
        names = [e["window"] for e in windowed]
        for task in run.tasks:
            values = [e[task]["ne"] if isinstance(e.get(task), dict) else None
                      for e in windowed]
            ax.plot(range(len(names)), [v if isinstance(v, (int, float)) else float("nan")
                                        for v in values], marker="o", label=task)
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="base rate")
        ax.set_xticks(range(len(names)), names, rotation=45 if len(names) > 6 else 0,
                      ha="right" if len(names) > 6 else "center")
        ax.set(xlabel="window (evaluated before training on it)",
               ylabel="normalized entropy", title="Progressive NE")
        ax.legend()
        plots["progressive"] = _save(fig, out / "progressive.png")

    world_size = run.summary["run"].get("world_size")
    if isinstance(world_size, int) and world_size > 1:  # one rank is balanced with itself
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(*_series(run.metrics, "rank_tokens_max_over_mean"), linewidth=1)
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set(xlabel="step", ylabel="max / mean tokens per rank", title="Per-rank balance")
        plots["balance"] = _save(fig, out / "balance.png")
    return plots


def padding_saved_per_step(metrics: Sequence[dict], spent: str,
                           padded: str) -> tuple[list[int], list[float]]:
    """``1 - spent / padded`` at each step that logged both (records before the per-step
    attention counts were logged have none)."""
    points = [(r["step"], 1 - r[spent] / r[padded]) for r in metrics
              if isinstance(r.get(spent), (int, float))
              and isinstance(r.get(padded), (int, float)) and r[padded]]
    return [p[0] for p in points], [p[1] for p in points]


def compare_plot(runs: Sequence[RunRecord], path: Path) -> Path:
    """Training loss and evaluation NE of several runs, overlaid."""
    plt = _pyplot()
    tasks = sorted({t for run in runs for t in run.tasks})
    fig, axes = plt.subplots(1, 1 + len(tasks), figsize=(5 * (1 + len(tasks)), 4))
    for run in runs:
        axes[0].plot(*_series(run.metrics, "loss"), label=run.label, linewidth=1)
        for ax, task in zip(axes[1:], tasks):
            ax.plot(*_ne_series(run.evals, task), marker="o", label=run.label)
    axes[0].set(xlabel="step", ylabel="training loss", yscale="log", title="Loss")
    for ax, task in zip(axes[1:], tasks):
        ax.set(xlabel="step", ylabel="NE", title=f"NE: {task}")
    axes[0].legend()
    return _save(fig, path)
