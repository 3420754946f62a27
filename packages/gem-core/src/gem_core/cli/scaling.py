"""``gem scaling``: train a sweep of model sizes for one budget; NE against FLOPs."""

from __future__ import annotations

from pathlib import Path

import click

from gem_core.cli.options import config_options


@click.command("scaling")
@config_options(preset_help="Base preset of every point", config_file=False,
                overrides_name="common",
                set_help="Override for every point, e.g. --set train.steps=200 (repeatable).")
@click.option("--point", "points", multiple=True, metavar="NAME:KEY=VALUE[,KEY=VALUE]",
              help="A sweep point (repeatable); default: a built-in depth x width x history "
                   "sweep around tiny.")
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="Directory for the runs, scaling.json, scaling.md and scaling.png.")
def scaling(preset: str | None, common: tuple[str, ...], points: tuple[str, ...],
            out: str) -> None:
    """Train each sweep point for the same steps; fit NE against log10(training FLOPs)."""
    from gem_core.report.scaling import DEFAULT_SWEEP, SweepPoint, parse_point, run_sweep

    try:
        sweep = ([parse_point(p) for p in points] if points
                 else [SweepPoint(name=n, overrides=o) for n, o in DEFAULT_SWEEP])
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--point") from None
    if len(sweep) < 2:
        raise click.BadParameter("a sweep needs at least two points", param_hint="--point")
    run_sweep(preset=preset, common=common, points=sweep, out=Path(out))
    click.echo((Path(out) / "scaling.md").read_text())
    click.echo(f"plot: {Path(out) / 'scaling.png'}")
