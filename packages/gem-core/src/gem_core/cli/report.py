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


def _print_table(labels: list[str], rows: list[tuple[str, list]]) -> None:
    from gem_core.report.html import display

    width = max(len(key) for key, _ in rows) + 2
    click.echo("".ljust(width) + "".join(label[:18].rjust(20) for label in labels))
    for key, values in rows:
        click.echo(key.ljust(width) + "".join(display(v)[:18].rjust(20) for v in values))
