"""``gem data import``: the command and :func:`import_logs`, which run an engine over the logs
and write the data set. What an import builds (requests, histories strictly before each
request, the split) is described in :mod:`gem_data.import_build`, the numpy engine and
reference; ``duckdb`` is :mod:`gem_data.import_duckdb`, ``spark`` :mod:`gem_data.import_spark`
(:mod:`gem_data.import_engines` opens either); ``--window`` / ``--append`` write time windows
(:mod:`gem_data.import_append`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from gem_data.import_build import (  # noqa: F401  (re-exported: the import's API)
    _build,
    build_requests,
    describe_import,
    import_info,
)
from gem_data.import_engines import ENGINES
from gem_data.import_options import (  # noqa: F401  (the [import] table's API, re-exported)
    ImportOptions,
    read_schema_file,
)

DEFAULT_ENGINE = "numpy"


def import_logs(impressions: str | Path, events: str | Path, schema_file: str | Path,
                out: str | Path, *, row_group_rows: int = 16384,
                vocabulary_from: str | Path | None = None, engine: str = DEFAULT_ENGINE,
                memory_limit: str | None = None, temp_dir: str | Path | None = None,
                threads: int | None = None, block_rows: int | None = None,
                block_bytes: int | None = None, window: str | None = None,
                append: bool = False, master: str | None = None) -> Any:
    """Import the logs into a data set directory ``out``; returns its manifest. Its ``info``
    says what share of the requests went to eval (``split``), how requests were keyed and how
    many rows were dropped (``requests``), per feature how many values were missing and what
    was done (``features``), lists the vocabularies written (``vocabularies``: path, size,
    SHA-256) and the engine that ran (``engine``). ``vocabulary_from``: a data set imported
    earlier whose vocabularies are used (values they lack get the out-of-vocabulary id)
    instead of building new ones. Written beside ``out`` and renamed into place when complete:
    a failed import leaves ``out`` as it was.

    ``engine``: ``numpy`` (both logs in memory, the reference), ``duckdb``
    (:mod:`gem_data.import_duckdb`: out of core under ``memory_limit``, spilling into
    ``temp_dir``, by default inside the staging directory; ``threads``: DuckDB's, default
    every core) or ``spark`` (:mod:`gem_data.import_spark`: on ``master``, default
    ``local[*]`` or the session running in this process; ``memory_limit``: the driver's
    heap; ``temp_dir``: where the logs are staged and Spark writes). ``block_rows`` /
    ``block_bytes``: rows of a Parquet block, bytes of a CSV block the engines other than
    numpy read at a time. All write the same requests.

    ``window``: the logs are one time window of that name: a data set of windows, every
    request in train, with each user's latest events kept for the next window; ``append``: add
    it to the data set of windows ``out`` (:mod:`gem_data.import_append`)."""
    from gem_core.errors import GemDataError
    from gem_data.import_engines import open_run, refuse_options
    from gem_data.import_strings import read_vocabularies
    from gem_data.writer import DatasetWriter, staged_directory

    if engine not in ENGINES:
        raise GemDataError(f"unknown engine {engine!r}; engines are {', '.join(ENGINES)}")
    run_options = {"memory_limit": memory_limit, "temp_dir": temp_dir, "threads": threads,
                   "block_rows": block_rows, "block_bytes": block_bytes, "master": master}
    refuse_options(engine, run_options)
    if window is not None or append:
        from gem_data.import_append import import_window

        return import_window(impressions, events, schema_file, out, window=window,
                             append=append, row_group_rows=row_group_rows,
                             vocabulary_from=vocabulary_from, engine=engine,
                             run_options=run_options)
    schema, options = read_schema_file(schema_file)
    given = read_vocabularies(vocabulary_from) if vocabulary_from is not None else None
    sources = {"impressions": impressions, "events": events, "schema_file": schema_file}
    with staged_directory(out) as staging:
        if engine == "numpy":
            splits, report = _build(impressions, events, schema, options, given)
            writer = DatasetWriter(staging, schema, row_group_rows=row_group_rows,
                                   info=import_info(sources, options, report, staging,
                                                    {"name": "numpy"}))
            for split, batch in splits.items():
                batch.validate(schema, where=f"{out} ({split})")
                writer.write(split, batch)
        else:
            with open_run(engine, impressions, events, schema, options, vocabularies=given,
                          earlier=None, run_options=run_options, staging=staging) as run:
                report = run.prepare()
                writer = DatasetWriter(staging, schema, row_group_rows=row_group_rows,
                                       info=import_info(sources, options, report, staging,
                                                        run.engine_info()))
                run.write(writer, str(out), row_group_rows)
        manifest = writer.close()
    return manifest


@click.command("import", help="Turn an impression log and an event log (Parquet or CSV), with "
                              "side tables joined by key, into a request-level data set in OUT, "
                              "with histories strictly before each request. See docs/byod.md.")
@click.option("--impressions", type=click.Path(dir_okay=False), required=True,
              help="Impression log: one row per candidate shown, with labels.")
@click.option("--events", type=click.Path(dir_okay=False), required=True,
              help="Event log: one row per history event.")
@click.option("--schema", "schema_file", type=click.Path(dir_okay=False), required=True,
              help="Schema TOML: features, tables, tasks and an optional [import] table.")
@click.option("--out", type=click.Path(file_okay=False), required=True,
              help="Output data set directory.")
@click.option("--row-group-rows", type=click.IntRange(min=1), default=16384, show_default=True,
              help="Requests per Parquet row group.")
@click.option("--vocabulary-from", "vocabulary_from", type=click.Path(file_okay=False),
              default=None, help="A data set imported before: use its vocabularies "
                                 "(import.strings = \"vocabulary\"); values they lack get the "
                                 "out-of-vocabulary id, counted.")
@click.option("--engine", type=click.Choice(ENGINES), default=DEFAULT_ENGINE, show_default=True,
              help="numpy: both logs in memory (the reference). duckdb: the join, grouping "
                   "and split in DuckDB, out of core (pip install 'gem-data[duckdb]'). spark: "
                   "the same in Apache Spark, here or on a cluster (pip install "
                   "'gem-data[spark]'; Java 17+).")
@click.option("--memory-limit", default=None, metavar="SIZE",
              help="duckdb: DuckDB's memory limit, e.g. 2GB (default: 80 % of the memory); "
                   "what does not fit spills to --temp-dir. spark: the driver's heap "
                   "(spark.driver.memory; default 1 GiB).")
@click.option("--temp-dir", type=click.Path(file_okay=False), default=None,
              help="duckdb, spark: where the logs are staged and the engine spills (default: "
                   "inside the staging directory beside OUT); removed after the import.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="duckdb: threads DuckDB runs on (default: every core).")
@click.option("--master", default=None, metavar="URL",
              help="spark: Spark's master, e.g. local[2] or spark://host:7077 (default: "
                   "local[*], or spark-submit's).")
@click.option("--window", default=None, metavar="NAME",
              help="The logs are one time window NAME (e.g. 2026-11-30) of a data set of "
                   "windows: every request in train, each user's latest events kept for the "
                   "next window.")
@click.option("--append", is_flag=True,
              help="With --window: add the window to the data set of windows OUT (its schema, "
                   "options and vocabularies; every request and event later than its last "
                   "window).")
def import_command(impressions: str, events: str, schema_file: str, out: str,
                   row_group_rows: int, vocabulary_from: str | None, engine: str,
                   memory_limit: str | None, temp_dir: str | None, threads: int | None,
                   master: str | None, window: str | None, append: bool) -> None:
    from gem_core.errors import GemError

    try:
        manifest = import_logs(impressions, events, schema_file, out,
                               row_group_rows=row_group_rows, vocabulary_from=vocabulary_from,
                               engine=engine, memory_limit=memory_limit, temp_dir=temp_dir,
                               threads=threads, window=window, append=append,
                               master=master)
    except GemError as error:
        raise click.ClickException(str(error)) from None
    from gem_data.import_split import describe

    if window is not None:
        from gem_data.import_append import describe_window

        lines = describe_window(manifest, out)
    else:
        lines = [f"wrote {manifest.rows('train')} train + {manifest.rows('eval')} eval "
                 f"requests ({manifest.tokens('train')} history events) to {out}; "
                 f"{describe(manifest.info['split'])}", *describe_import(manifest.info)]
    for line in lines:
        click.echo(line)
