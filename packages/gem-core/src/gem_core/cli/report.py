"""``gem report`` and ``gem runs compare``."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command("report")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--out", default=None, type=click.Path(file_okay=False),
              help="Where to write the page and plots (default: RUN_DIR/report).")
def report(run_dir: str, out: str | None) -> None:
    """Plots (loss, NE, throughput, MFU, padding, balance) and an HTML page for one run."""
    from gem_core.report.html import write_report
    from gem_core.report.plots import run_plots
    from gem_core.report.runs import read_run

    run = read_run(run_dir)
    target = Path(out) if out else Path(run_dir) / "report"
    page = write_report(run, run_plots(run, target), target / "index.html")
    click.echo(str(page))


@click.group("runs")
def runs() -> None:
    """Work with several run directories."""


@runs.command("compare")
@click.argument("run_dirs", nargs=-1, required=True,
                type=click.Path(exists=True, file_okay=False))
@click.option("--plot", default=None, type=click.Path(dir_okay=False),
              help="Write the overlaid loss/NE plot to this PNG.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def compare(run_dirs: tuple[str, ...], plot: str | None, as_json: bool) -> None:
    """Final metrics and efficiency of runs side by side, the config keys that differ between
    them, and a warning when they were trained on different data."""
    from gem_core.report.html import summary_rows
    from gem_core.report.plots import compare_plot
    from gem_core.report.runs import config_differences, data_differences, read_run

    records = [read_run(d) for d in run_dirs]
    table = {r.label: dict(summary_rows(r)) for r in records}
    differences = config_differences(records)
    data_warnings = data_differences(records)
    if plot:
        compare_plot(records, Path(plot))
    if as_json:
        click.echo(json.dumps({"runs": table, "config_differences": {
            key: dict(zip(table, values)) for key, values in differences.items()},
            "data_warnings": data_warnings, "plot": plot}))
        return
    for warning in data_warnings:
        click.echo(f"warning: {warning}", err=True)
    labels = [r.label for r in records]
    rows = [(key, [table[label].get(key) for label in labels])
            for key in dict.fromkeys(k for r in table.values() for k in r)]
    _print_table(labels, rows)
    click.echo("")
    if differences:
        click.echo("config differences:")
        _print_table(labels, list(differences.items()))
    else:
        click.echo("config differences: none (the runs have the same config)")


@runs.command("seeds")
@click.argument("run_dirs", nargs=-1, required=True,
                type=click.Path(exists=True, file_okay=False))
@click.option("--seed-key", "seed_keys", multiple=True,
              help="A config key whose values tell the repetitions of one configuration apart "
                   "(repeatable; default: train.seed and data.path).")
@click.option("--ignore-key", "ignored_keys", multiple=True,
              help="A config key that does not set configurations apart in these runs "
                   "(repeatable), such as a setting that does not act in them.")
@click.option("--last", is_flag=True,
              help="Compare each run's last evaluation (the model as training left it) instead "
                   "of its reported one (the checkpoint it chose).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def seeds(run_dirs: tuple[str, ...], seed_keys: tuple[str, ...], ignored_keys: tuple[str, ...],
          last: bool, as_json: bool) -> None:
    """Configurations repeated over seeds, each compared with the first seed by seed: every
    task's NE, AUC and GAUC as mean and standard deviation over its runs, and the paired
    difference to the first configuration with the number of seeds it is better on."""
    from gem_core.report.runs import read_run
    from gem_core.report.seeds import DEFAULT_SEED_KEYS, arms_json, seed_arms

    seed_keys = seed_keys or DEFAULT_SEED_KEYS
    arms = seed_arms([read_run(d) for d in run_dirs], seed_keys, ignored_keys, last=last)
    if as_json:
        click.echo(json.dumps(arms_json(arms, seed_keys)))
        return
    # One column for the figures' names, wide enough for the longest (conversion.gauc).
    width = max([14] + [len(name) + 2 for arm in arms for name in arm.figures])
    for number, arm in enumerate(arms, 1):
        click.echo(f"arm {number}: {arm.label} ({len(arm.runs)} runs: "
                   f"{', '.join(r.label for r in arm.runs.values())})")
        if number > 1 and not arm.paired:
            click.echo("  (no seed in common with arm 1: not paired)")
        for seed, run in arm.unpaired.items():
            click.echo(f"  unpaired: {run.label} ({_seed_text(seed_keys, seed)}): arm 1 has no "
                       f"run with these seed values")
        for seed in arm.missing:
            click.echo(f"  missing: arm 1's {_seed_text(seed_keys, seed)} (no run here)")
        for name, spread in arm.figures.items():
            line = f"  {name:<{width}}{spread.mean:.4f} ± {spread.sd:.4f} ({spread.count})"
            if name in arm.paired:
                diff = arm.paired[name]
                line += (f"   paired {diff.mean:+.4f} ± {diff.sd:.4f}, better on "
                         f"{arm.better[name]} of {diff.count}")
            click.echo(line)


def _seed_text(seed_keys: tuple[str, ...], seed: tuple) -> str:
    """One run's seed values as ``key=value`` pairs (values as the arms compare them)."""
    return ", ".join(f"{key}={value}" for key, value in zip(seed_keys, seed))


def _print_table(labels: list[str], rows: list[tuple[str, list]]) -> None:
    from gem_core.report.html import display

    width = max(len(key) for key, _ in rows) + 2
    click.echo("".ljust(width) + "".join(label[:18].rjust(20) for label in labels))
    for key, values in rows:
        click.echo(key.ljust(width) + "".join(display(v)[:18].rjust(20) for v in values))
