"""``gem data``: synth, fetch, validate and inspect data sets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from gem_core.config import structure
from gem_core.config.loading import apply_overrides
from gem_core.errors import GemError


@click.group(name="data", help="Make, obtain, check and describe data sets.")
def data_group() -> None:
    pass


def _fail(error: GemError) -> None:
    raise click.ClickException(str(error))


@data_group.command("synth", help="Generate a synthetic ads log as a Parquet data set in OUT.")
@click.option("--rows", type=click.IntRange(min=1), default=1_000_000, show_default=True,
              help="Training impressions.")
@click.option("--eval-rows", type=click.IntRange(min=0), default=8192, show_default=True,
              help="Held-out impressions (written to a separate eval file set).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the whole data set.")
@click.option("--out", type=click.Path(file_okay=False), required=True, help="Output directory.")
@click.option("--row-group-rows", type=click.IntRange(min=1), default=16384, show_default=True,
              help="Rows per Parquet row group (the unit of sharding and resuming).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Generator option, e.g. --set length_distribution=zipf --set max_length=4096.")
def synth_command(rows: int, eval_rows: int, seed: int, out: str, row_group_rows: int,
                  overrides: tuple[str, ...]) -> None:
    from gem_data.generator import SynthOptions
    from gem_data.synth import synthesize

    try:
        options = structure(SynthOptions, apply_overrides({}, overrides), "synth")
        manifest = synthesize(out, rows=rows, seed=seed, eval_rows=eval_rows, options=options,
                              row_group_rows=row_group_rows)
    except GemError as error:
        _fail(error)
    click.echo(f"wrote {manifest.rows('train')} train + {manifest.rows('eval')} eval rows "
               f"({manifest.tokens('train')} history events) to {out}")


@data_group.command("fetch", help="Download a public data set (movielens-100k) into the cache.")
@click.argument("name", type=click.Choice(["movielens-100k"]))
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="Cache folder (default $GEM_DATA_CACHE or ~/.cache/gem-data).")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Also convert it into a Parquet data set here.")
@click.option("--max-history", type=click.IntRange(min=1), default=256, show_default=True,
              help="Most recent ratings kept as an impression's history (with --out).")
@click.option("--eval-fraction", type=click.FloatRange(0.01, 0.5), default=0.1,
              show_default=True, help="Latest share of ratings held out (with --out).")
def fetch_command(name: str, cache_dir: str | None, out: str | None, max_history: int,
                  eval_fraction: float) -> None:
    from gem_data.fetch import fetch_movielens
    from gem_data.movielens import write_movielens

    try:
        raw = fetch_movielens(cache_dir)
        click.echo(f"{name}: raw files in {raw}")
        if out:
            manifest = write_movielens(raw, out, max_history=max_history,
                                       eval_fraction=eval_fraction)
            click.echo(f"wrote {manifest.rows('train')} train + {manifest.rows('eval')} eval "
                       f"impressions to {out}")
    except GemError as error:
        _fail(error)


@data_group.command("validate", help="Check every row of the data set in DIRECTORY.")
@click.argument("directory", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def validate_command(directory: str, as_json: bool) -> None:
    from gem_data.check import validate_dataset

    result = validate_dataset(Path(directory))
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        for message in result["errors"]:
            click.echo(f"error: {message}", err=True)
        click.echo(f"{directory}: {result['rows_checked']} rows checked in "
                   f"{result['row_groups']} row groups, {len(result['errors'])} errors")
    if result["errors"]:
        raise SystemExit(1)


@data_group.command("inspect", help="Describe the data set in DIRECTORY.")
@click.argument("directory", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def inspect_command(directory: str, as_json: bool) -> None:
    from gem_data.check import describe_dataset

    try:
        info = describe_dataset(Path(directory))
    except GemError as error:
        _fail(error)
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    for key, value in info.items():
        click.echo(f"{key}: {_short(value)}")


def _short(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)
