"""``gem precision compare``: one model, data and seed trained under several precision recipes;
NE per task and its relative drift from fp32, plus fp8-auto's per-layer table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import click

from gem_core.cli.options import config_options

DEFAULT_RECIPES = ("fp32", "bf16", "fp8-rowwise", "fp8-auto")
AUTO = "fp8-auto"
LAYER_TABLE = "fp8_auto_layers.json"
STASH = "+stash"
"""Suffix of an FP8 recipe name in --recipes: the same recipe with the FP8 activation stash."""


def run_overrides(recipe: str, overrides: Sequence[str], out: Path) -> list[str]:
    """The --set list of one run: ``precision.*`` overrides are fp8-auto's options (other recipes
    take different or no options), and fp8-auto writes its table into its run directory."""
    shared = [o for o in overrides if not o.strip().startswith("precision.")]
    base = recipe.removesuffix(STASH)
    chosen = [f"backends.precision={base}"]
    if recipe.endswith(STASH):
        chosen.append("precision.options.activation_fp8=true")
    if base == AUTO:
        chosen += [o for o in overrides if o.strip().startswith("precision.")]
        if not any(o.strip().startswith("precision.options.report_path") for o in overrides):
            path = json.dumps(str(out / recipe / LAYER_TABLE))  # a TOML string literal
            chosen.append(f"precision.options.report_path={path}")
    return shared + chosen


def drift_table(results: dict[str, dict[str, float]], reference: str) -> list[dict[str, Any]]:
    """One row per recipe and task: NE and its relative drift from ``reference``'s NE."""
    rows = []
    for recipe, ne in results.items():
        for task, value in ne.items():
            ref = results.get(reference, {}).get(task)
            drift = (value - ref) / ref if ref else None
            rows.append({"recipe": recipe, "task": task, "ne": value, "drift_from_fp32": drift})
    return rows


def format_drift(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'recipe':<18} {'task':<12} {'NE':>8} {'drift vs fp32':>14}"]
    for r in rows:
        drift = "-" if r["drift_from_fp32"] is None else f"{r['drift_from_fp32']:+.3%}"
        lines.append(f"{r['recipe']:<18} {r['task']:<12} {r['ne']:>8.5f} {drift:>14}")
    return "\n".join(lines)


@click.command("compare")
@config_options(set_help="Override a key for every run, e.g. --set train.steps=50 "
                         "(repeatable); precision.* keys go to fp8-auto only.")
@click.option("--recipes", default=",".join(DEFAULT_RECIPES), show_default=True,
              help="Comma-separated precision recipes; fp32 must be one (the reference). An FP8 "
                   f"recipe with '{STASH}' (fp8-rowwise{STASH}) also stores activations in FP8.")
@click.option("--out", default="runs/precision-compare", show_default=True,
              type=click.Path(file_okay=False), help="Directory of the runs and the report.")
def compare(preset, config_file, overrides, recipes, out) -> None:
    """Train the same model, data and seed under each recipe; print and save NE drift."""
    from gem_core.config import load_config
    from gem_core.plugins import build_plugins
    from gem_core.train.trainer import train

    names = [r.strip() for r in recipes.split(",") if r.strip()]
    if "fp32" not in names:
        raise click.UsageError("--recipes must include fp32, the reference of the drift")
    for name in names:
        if name.endswith(STASH) and not name.startswith("fp8-"):
            raise click.UsageError(f"{name}: the activation stash is an option of the fp8 recipes")
    out_dir = Path(out).resolve()
    plugins = build_plugins()
    results: dict[str, dict[str, float]] = {}
    for name in names:
        config = load_config(preset=preset, path=config_file,
                             overrides=run_overrides(name, overrides, out_dir))
        click.echo(f"== {name}", err=True)
        result = train(config, plugins, out_dir / name, fresh=True, progress=False)
        results[name] = {task: float(m["ne"]) for task, m in result.summary["eval"].items()}
    rows = drift_table(results, "fp32")
    report: dict[str, Any] = {"recipes": names, "ne": rows}
    text = format_drift(rows)
    table_path = out_dir / AUTO / LAYER_TABLE
    if AUTO in names and table_path.exists():
        report["fp8_auto_layers"] = json.loads(table_path.read_text())
        text += "\n\n" + table_path.with_suffix(".txt").read_text()
    (out_dir / "compare.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "compare.txt").write_text(text + "\n")
    click.echo(text)
    click.echo(f"saved {out_dir / 'compare.json'} and {out_dir / 'compare.txt'}")
