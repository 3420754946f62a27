"""``gem scaling``: NE against training compute over a sweep of model sizes.

Each point of the sweep is the base configuration with a few overrides (depth, width, history
length), trained for the same number of steps on the same data with the same seed; its training
FLOPs come from the trainer's analytic count over the real jagged lengths (``summary.json``).
A least-squares fit ``NE = a + b * log10(FLOPs)`` over the points is the log-linear scaling law
the LLaTTE and Wukong papers report; ``b < 0`` means NE falls as compute grows.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

import attrs

DEFAULT_SWEEP: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("d16-l1-h32", ("model.embedding_dim=16", "model.num_layers=1", "data.max_seq_len=32")),
    ("d16-l1-h64", ("model.embedding_dim=16", "model.num_layers=1", "data.max_seq_len=64")),
    ("d32-l1-h64", ("model.embedding_dim=32", "model.num_layers=1", "data.max_seq_len=64")),
    ("d32-l2-h128", ("model.embedding_dim=32", "model.num_layers=2", "data.max_seq_len=128")),
    ("d48-l3-h128", ("model.embedding_dim=48", "model.num_layers=3", "data.max_seq_len=128")),
)
"""Depth, width and history length growing together from well below ``tiny`` to above it."""


@attrs.frozen(kw_only=True)
class SweepPoint:
    name: str
    """Label of the point (also its run directory's name)."""

    overrides: tuple[str, ...]
    """``key=value`` overrides applied on top of the base configuration."""


def parse_point(text: str) -> SweepPoint:
    """``NAME:key=value,key=value`` as given to ``--point``."""
    name, sep, rest = text.partition(":")
    overrides = tuple(o.strip() for o in rest.split(",") if o.strip())
    if not sep or not name or not overrides or any("=" not in o for o in overrides):
        raise ValueError(f"--point {text!r} must be NAME:key=value[,key=value...]")
    return SweepPoint(name=name, overrides=overrides)


def log_linear_fit(flops: Sequence[float], ne: Sequence[float]) -> dict[str, float]:
    """Least-squares ``ne = intercept + slope * log10(flops)`` and its R^2."""
    xs = [math.log10(f) for f in flops]
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ne) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if n < 2 or sxx == 0:
        raise ValueError("a log-linear fit needs at least two points of different compute")
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ne)) / sxx
    intercept = mean_y - slope * mean_x
    total = sum((y - mean_y) ** 2 for y in ne)
    residual = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ne))
    return {"intercept": intercept, "slope_per_decade": slope,
            "r2": 1 - residual / total if total else 1.0}


def run_sweep(*, preset: str | None, common: Sequence[str], points: Sequence[SweepPoint],
              out: Path) -> dict[str, Any]:
    """Train every point into ``out/NAME`` and return the table and fit."""
    from gem_core.config import DEFAULT_PRESET, load_config
    from gem_core.plugins import build_plugins
    from gem_core.train.trainer import train

    plugins = build_plugins()
    rows = []
    for point in points:
        config = load_config(preset=preset, overrides=[*common, *point.overrides])
        result = train(config, plugins, out / point.name, fresh=True, progress=False)
        s = result.summary
        ne = {task: values["ne"] for task, values in s["eval"].items()}
        rows.append({
            "name": point.name, "overrides": list(point.overrides),
            "steps": s["run"]["steps"], "train_flops": s["flops"]["per_step"] * s["run"]["steps"],
            "flops_per_step": s["flops"]["per_step"],
            "parameters_dense": _dense_parameters(config),
            "ne": ne, "ne_mean": sum(ne.values()) / len(ne),
            "wall_time_s": s["run"]["wall_time_s"],
        })
    fit = log_linear_fit([r["train_flops"] for r in rows], [r["ne_mean"] for r in rows])
    report = {"preset": preset or DEFAULT_PRESET, "common_overrides": list(common), "points": rows,
              "fit": fit, "metric": "mean over tasks of the final eval NE"}
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "scaling.md").write_text(markdown_table(report))
    plot_scaling(report, out / "scaling.png")
    return report


def _dense_parameters(config: Any) -> int:
    from gem_core.model.summary import meta_model, parameter_counts
    from gem_core.plugins import build_plugins
    from gem_core.train.applied import config_as_source_applies

    source = build_plugins().data_source(config.data, seed=0)
    # the model the point's run trained (e.g. a view action given as text, as its id)
    return parameter_counts(meta_model(config_as_source_applies(config, source).model,
                                       source.schema))["dense"]


def markdown_table(report: dict[str, Any]) -> str:
    tasks = list(report["points"][0]["ne"]) if report["points"] else []
    lines = ["| point | dense params | train FLOPs | " + " | ".join(f"{t} NE" for t in tasks)
             + " | mean NE |", "|---|---|---|" + "---|" * len(tasks) + "---|"]
    for r in report["points"]:
        lines.append(f"| {r['name']} | {r['parameters_dense']:,} | {r['train_flops']:.3g} | "
                     + " | ".join(f"{r['ne'][t]:.4f}" for t in tasks)
                     + f" | {r['ne_mean']:.4f} |")
    fit = report["fit"]
    lines.append("")
    lines.append(f"Fit: NE = {fit['intercept']:.4f} {fit['slope_per_decade']:+.4f} x "
                 f"log10(training FLOPs), R^2 = {fit['r2']:.3f}")
    return "\n".join(lines) + "\n"


def plot_scaling(report: dict[str, Any], path: Path) -> Path:
    from gem_core.report.plots import _pyplot, _save

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    flops = [r["train_flops"] for r in report["points"]]
    ne = [r["ne_mean"] for r in report["points"]]
    ax.scatter(flops, ne, zorder=3)
    for r in report["points"]:
        ax.annotate(r["name"], (r["train_flops"], r["ne_mean"]), fontsize=7,
                    textcoords="offset points", xytext=(4, 4))
    fit = report["fit"]
    lo, hi = math.log10(min(flops)), math.log10(max(flops))
    xs = [10 ** (lo + (hi - lo) * i / 20) for i in range(21)]
    ax.plot(xs, [fit["intercept"] + fit["slope_per_decade"] * math.log10(x) for x in xs],
            linestyle="--", label=f"{fit['slope_per_decade']:+.4f} NE per decade "
                                  f"(R² {fit['r2']:.2f})")
    ax.set_xscale("log")
    ax.set_xlabel("training FLOPs (analytic, jagged)")
    ax.set_ylabel("eval NE (mean over tasks)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)
