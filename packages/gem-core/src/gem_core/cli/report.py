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
    """Final metrics and efficiency of runs side by side."""
    from gem_core.report.html import summary_rows
    from gem_core.report.plots import compare_plot
    from gem_core.report.runs import read_run

    records = [read_run(d) for d in run_dirs]
    table = {r.label: dict(summary_rows(r)) for r in records}
    if plot:
        compare_plot(records, Path(plot))
    if as_json:
        click.echo(json.dumps({"runs": table, "plot": plot}))
        return
    labels = [r.label for r in records]
    keys = list(dict.fromkeys(k for r in table.values() for k in r))
    width = max(len(k) for k in keys) + 2
    click.echo("".ljust(width) + "".join(label[:18].rjust(20) for label in labels))
    for key in keys:
        cells = []
        for label in labels:
            value = table[label].get(key)
            cells.append((f"{value:.4g}" if isinstance(value, float) else str(value))[:18]
                         .rjust(20))
        click.echo(key.ljust(width) + "".join(cells))
