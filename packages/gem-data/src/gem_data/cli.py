"""``gem data``: synth, fetch, validate, inspect, schema and convert data sets."""

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
@click.option("--windows", type=click.IntRange(min=1), default=None,
              help="Write N consecutive time windows (one day each: day-000, day-001, ...) "
                   "of --window-rows requests instead of --rows and --eval-rows: the click "
                   "process drifts "
                   "(drift_weight and drift_period, in windows, have window defaults unless "
                   "--set), new ads appear, and each window records its true probabilities "
                   "(docs/data-format.md).")
@click.option("--window-rows", type=click.IntRange(min=1), default=100_000, show_default=True,
              help="Requests per window (with --windows).")
@click.option("--new-ads", type=click.FloatRange(0.0, 1.0, max_open=True), default=0.05,
              show_default=True, help="Share of the catalogue's ads replaced by new ads (fresh "
              "ids) at each window after the first (with --windows).")
def synth_command(rows: int, eval_rows: int, seed: int, out: str, row_group_rows: int,
                  overrides: tuple[str, ...], windows: int | None, window_rows: int,
                  new_ads: float) -> None:
    from click.core import ParameterSource

    from gem_data.synth import synthesize
    from gem_data.synth_options import SynthOptions

    given = {name for name in ("rows", "eval_rows", "window_rows", "new_ads")
             if click.get_current_context().get_parameter_source(name)
             not in (ParameterSource.DEFAULT, None)}
    # Refused rather than ignored: a windowed set has no eval split (each window is evaluated
    # before training on it) and its size is --windows x --window-rows.
    if windows is not None and given & {"rows", "eval_rows"}:
        raise click.UsageError("--rows and --eval-rows do not apply with --windows: the data "
                               "set is --windows x --window-rows requests and has no eval split")
    if windows is None and given & {"window_rows", "new_ads"}:
        raise click.UsageError("--window-rows and --new-ads need --windows N")
    try:
        if windows is not None:
            from gem_data.synth_windows import synthesize_windows, window_synth_options

            manifest = synthesize_windows(
                out, windows=windows, window_rows=window_rows, seed=seed,
                options=window_synth_options(apply_overrides({}, overrides)),
                new_ads_per_window=new_ads, row_group_rows=row_group_rows)
            click.echo(f"wrote {len(manifest.windows)} windows of {window_rows} requests "
                       f"({manifest.tokens('train')} history events) to {out}")
            return
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


@data_group.command("validate", help="Check every request of the data set in DIRECTORY.")
@click.argument("directory", type=click.Path())
@click.option("--schema", "schema_file", type=click.Path(dir_okay=False), default=None,
              help="A TOML schema (docs/data-format.md) to check the files against instead of "
                   "the manifest's; DIRECTORY may then be Parquet files without a manifest. "
                   "An [import] table (gem data import's options) is checked as the import "
                   "reads it and not compared: only the feature schema is.")
@click.option("--write-digests", is_flag=True,
              help="When every check passes, record each file's size and SHA-256 in "
                   "manifest.json (data sets written before gem-data recorded them).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def validate_command(directory: str, schema_file: str | None, write_digests: bool,
                     as_json: bool) -> None:
    from gem_data.check import load_schema_file, validate_dataset, validation_summary

    try:
        schema = load_schema_file(schema_file) if schema_file else None
    except GemError as error:
        _fail(error)
    result = validate_dataset(Path(directory), schema, write_digests=write_digests)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        for warning in result.get("warnings", []):
            click.echo(f"warning: {warning}", err=True)
        if result.get("digests_written"):
            click.echo(f"recorded the size and SHA-256 of {result['digests_written']} file(s) "
                       "in manifest.json", err=True)
        for difference in result.get("schema_differences", []):
            click.echo(f"note: --schema differs from the manifest's schema in {difference}",
                       err=True)
        for message in result["errors"]:
            click.echo(f"error: {message}", err=True)
        click.echo(validation_summary(result))
    if result["errors"]:
        raise SystemExit(1)


@data_group.command("inspect", help="Describe the data set in DIRECTORY: per split the "
                    "history lengths and candidates per request, per time window its time range, "
                    "requests and state files, per table the id collision rate under its id "
                    "policy.")
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
        if key == "tables":
            for name, table in value.items():
                click.echo(f"table {name}: {table['id_policy']}, {table['num_embeddings']} rows, "
                           f"{table['distinct_ids']} distinct ids on {table['rows_used']} rows, "
                           f"collision rate {table['collision_rate']:.4f}")
            continue
        if key == "windows":  # one line per time window, oldest first
            for w in value:
                state = ", ".join(f"{s['path']} ({s['rows']} rows, {s['size']} bytes)"
                                  for s in w["state"]) or "none"
                click.echo(f"window {w['name']}: {w['first_time_utc']} .. {w['last_time_utc']} "
                           f"({w['first_time']} .. {w['last_time']} s), {w['requests']} "
                           f"requests, {w['history_events']} history events; state: {state}")
            continue
        click.echo(f"{key}: {_short(value)}")


@data_group.group("schema", help="Check a TOML schema file, or show a data set's schema as "
                  "TOML.")
def schema_group() -> None:
    pass


@schema_group.command("check", help="Parse and check the TOML schema FILE; print it back. "
                      "An [import] table (gem data import's options) is checked by the "
                      "importer's own parser, against the schema, and printed back with the "
                      "value of every key.")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True,
              help="Print the schema as JSON (with an [import] table: under \"import\").")
def schema_check_command(file: str, as_json: bool) -> None:
    import attrs

    from gem_core.schema import schema_to_dict
    from gem_data.check import import_to_toml, read_schema_and_import, schema_to_toml

    try:
        schema, options = read_schema_and_import(file)
    except GemError as error:
        _fail(error)
    if as_json:
        data = schema_to_dict(schema)
        if options is not None:
            data["import"] = attrs.asdict(options)
        click.echo(json.dumps(data, indent=2))
        return
    click.echo(schema_to_toml(schema), nl=False)
    if options is not None:
        click.echo("\n" + import_to_toml(options), nl=False)


@schema_group.command("show", help="Print the schema of the data set in DIRECTORY as TOML.")
@click.argument("directory", type=click.Path())
def schema_show_command(directory: str) -> None:
    from gem_data.check import schema_to_toml
    from gem_data.manifest import read_manifest

    try:
        click.echo(schema_to_toml(read_manifest(directory).schema), nl=False)
    except GemError as error:
        _fail(error)


@data_group.command("convert", help="Rewrite the format 1 data set OLD (one row per "
                    "impression) as a format 2 data set (one row per request) in OUT.")
@click.argument("old", type=click.Path(file_okay=False))
@click.option("--out", type=click.Path(file_okay=False), required=True, help="New directory.")
def convert_command(old: str, out: str) -> None:
    from gem_data.convert import convert_v1

    try:
        manifest = convert_v1(old, out)
    except GemError as error:
        _fail(error)
    click.echo(f"wrote {manifest.rows('train')} train + {manifest.rows('eval')} eval requests "
               f"(format 2) to {out}")


def _short(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def _register_import() -> None:
    # The importer module carries its own click command (it is large); imported lazily by click
    # only through this registration, like the group's other commands.
    from gem_data.importer import import_command

    data_group.add_command(import_command)


_register_import()
