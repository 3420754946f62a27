"""``gem bench import``: rows/s and peak memory of ``gem data import`` with each engine, on the
same generated logs, side by side.

The logs (:func:`write_logs`, Parquet or CSV) are an ads log shaped like the ones the importer
is for: ``--impressions`` impressions in requests of 1-4 candidates, ``--events`` history events
of the same users, hashed 64-bit ad ids (half of them 2^63 and more, as uint64), a multi-valued
topic feature, a context feature, a dense column, a click label, no request id (a request is
one user at one time). Each engine imports them in a child process of its own, so that its peak
memory is its own: for numpy and DuckDB, ``ru_maxrss`` of the child (the largest resident set
it had, DuckDB's memory included); for Spark, the child (the driver) plus Spark's JVM and the
JVM's Python workers, their resident sets summed, sampled every 0.2 s
(:mod:`gem_data.process_memory`; the JVM's heap is ``--memory-limit``). rows/s is impressions
plus events over the child's wall time of the import (reading, joining, writing, checking; for
Spark also starting its JVM), not counting the start of Python.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

SCHEMA = '''tasks = ["click"]
max_seq_len = 256
num_dense = 1
[[tables]]
name = "ad"
num_embeddings = 100000
id_policy = "hash"
[[tables]]
name = "topic"
num_embeddings = 1000
id_policy = "modulo"
[[tables]]
name = "action"
num_embeddings = 4
[[tables]]
name = "slot"
num_embeddings = 8
[[event_features]]
name = "ad"
table = "ad"
[[event_features]]
name = "topics"
table = "topic"
multi_valued = true
[[event_features]]
name = "action"
table = "action"
[[candidate_features]]
name = "ad"
table = "ad"
[[candidate_features]]
name = "topics"
table = "topic"
multi_valued = true
[[sparse_features]]
name = "slot"
table = "slot"
[import]
dense_columns = ["price_level"]
eval_fraction = 0.1
'''


def write_logs(directory: str | Path, impressions: int, events: int, *, seed: int = 0,
               kind: str = "parquet", users: int | None = None, block: int = 1 << 20
               ) -> tuple[Path, Path, Path]:
    """Generated logs of ``impressions`` and ``events`` rows and their schema file in
    ``directory``: ``(impressions, events, schema)``. Written ``block`` rows at a time, so
    generating needs little memory whatever the size."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    users = users or max(1, impressions // 20)
    rng = np.random.default_rng(seed)
    ads = rng.integers(0, 2**64 - 1, 50_000, dtype=np.uint64, endpoint=True)
    start = 1_700_000_000
    span = max(30 * 86400, impressions)
    seconds = rng.permutation(span)[:impressions]
    requests = [0]

    def topics(count: int) -> Any:
        lengths = rng.integers(1, 4, count)
        offsets = np.zeros(count + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        return pa.ListArray.from_arrays(pa.array(offsets),
                                        pa.array(rng.integers(0, 5000, int(offsets[-1]))))

    def impression_block(count: int) -> Any:
        # Requests of 1-4 impressions: one user, one time, one slot and price level each.
        sizes = rng.integers(1, 5, count)
        sizes = sizes[np.cumsum(sizes) <= count]
        sizes = np.r_[sizes, count - sizes.sum()] if sizes.sum() < count else sizes
        n = sizes.size
        user = np.repeat(rng.integers(0, users, n), sizes)
        # Each request its own second (a request is one user at one time: no two may share
        # both), spread over the span in random order.
        when = np.repeat(start + seconds[requests[0]:requests[0] + n], sizes)
        requests[0] += n
        return pa.table({"user_id": user, "timestamp": when,
                         "ad": pa.array(ads[rng.integers(0, ads.size, count)], pa.uint64()),
                         "topics": topics(count),
                         "slot": np.repeat(rng.integers(0, 8, n), sizes),
                         "price_level": np.repeat(rng.integers(0, 5, n), sizes).astype(float),
                         "click": (rng.random(count) < 0.1).astype(np.int64)})

    def event_block(count: int) -> Any:
        return pa.table({"user_id": rng.integers(0, users, count),
                         "timestamp": start - 86400 + rng.integers(0, span + 86400, count),
                         "ad": pa.array(ads[rng.integers(0, ads.size, count)], pa.uint64()),
                         "topics": topics(count),
                         "action": rng.integers(0, 4, count)})

    def as_csv(table: Any) -> Any:
        return pa.table({c: (pa.array(["|".join(map(str, v)) for v in table.column(c).to_pylist()],
                                      pa.string())
                             if pa.types.is_list(table.column(c).type) else table.column(c))
                         for c in table.column_names})

    paths = []
    for name, rows, make in (("impressions", impressions, impression_block),
                             ("events", events, event_block)):
        path = directory / f"{name}.{kind}"
        paths.append(path)
        writer: Any = None
        for first in range(0, max(rows, 1), block):
            table = make(min(block, rows - first))
            table = as_csv(table) if kind == "csv" else table
            if writer is None:
                writer = pacsv.CSVWriter(path, table.schema) if kind == "csv" \
                    else pq.ParquetWriter(path, table.schema)
            writer.write_table(table)
        writer.close()
    schema = directory / "schema.toml"
    schema.write_text(SCHEMA)
    return paths[0], paths[1], schema


def _child(arguments: dict[str, Any]) -> None:
    """One import, in this process (the child): prints its wall time and peak memory."""
    import resource

    from gem_data.importer import import_logs
    from gem_data.process_memory import TreePeak

    start = time.perf_counter()
    options = {k: v for k, v in arguments.get("options", {}).items() if v is not None}
    with TreePeak(0.2) as tree:  # the JVM's memory and its workers' (spark)
        manifest = import_logs(arguments["impressions"], arguments["events"],
                               arguments["schema"], arguments["out"],
                               engine=arguments["engine"], **options)
    seconds = time.perf_counter() - start
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    result = {"seconds": seconds, "peak_rss_bytes": own, "measured": "ru_maxrss of the process",
              "requests": manifest.rows("train") + manifest.rows("eval"),
              "history_events": manifest.tokens("train") + manifest.tokens("eval"),
              "engine_info": manifest.info.get("engine")}
    if arguments["engine"] == "spark":
        result.update(peak_rss_bytes=max(own, tree.peak),
                      peak_rss_parts={"driver": own, "jvm": tree.parts["jvm"],
                                      "python_workers": tree.parts["other"]},
                      measured="driver + JVM + Python workers, summed, sampled every 0.2 s")
    print(json.dumps(result))


def run_engine(engine: str, impressions: Path, events: Path, schema: Path, out: Path,
               rows: int, **options: Any) -> dict[str, Any]:
    """Import with ``engine`` in a child process; its measurements (or its error)."""
    arguments = {"engine": engine, "impressions": str(impressions), "events": str(events),
                 "schema": str(schema), "out": str(out), "options": options}
    done = subprocess.run([sys.executable, "-c", "import sys, json; from gem_data.bench_import "
                           "import _child; _child(json.loads(sys.argv[1]))",
                           json.dumps(arguments)], capture_output=True, text=True)
    if done.returncode:
        lines = [line for line in done.stderr.strip().splitlines() if line]
        return {"engine": engine, "error": lines[-1] if lines else f"exit {done.returncode}"}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result.update(engine=engine, rows_per_s=rows / result["seconds"])
    return result


@click.command(name="import", help=__doc__.split("\n\n")[0])
@click.option("--impressions", type=click.IntRange(min=1), default=200_000, show_default=True,
              help="Impressions to generate.")
@click.option("--events", type=click.IntRange(min=0), default=1_000_000, show_default=True,
              help="History events to generate.")
@click.option("--format", "kind", type=click.Choice(["parquet", "csv"]), default="parquet",
              show_default=True, help="File format of the generated logs.")
@click.option("--engines", default="numpy,duckdb,spark", show_default=True,
              help="Engines to run, comma-separated.")
@click.option("--memory-limit", default="2GB", show_default=True,
              help="DuckDB's memory limit and Spark's driver heap (--engine duckdb, spark).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="DuckDB's threads (default: every core).")
@click.option("--master", default=None, metavar="URL",
              help="Spark's master (default: local[*]).")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None,
              help="Where to generate the logs and import them (default: a temporary "
                   "directory, removed afterwards).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_import(impressions: int, events: int, kind: str, engines: str, memory_limit: str,
                 threads: int | None, master: str | None, directory: str | None,
                 as_json: bool) -> None:
    from gem_data.importer import ENGINES

    chosen = [e.strip() for e in engines.split(",") if e.strip()]
    unknown = [e for e in chosen if e not in ENGINES]
    if unknown or not chosen:
        raise click.BadParameter(f"{', '.join(unknown) or engines!r}: engines are "
                                 f"{', '.join(ENGINES)}", param_hint="--engines")
    with tempfile.TemporaryDirectory(prefix="gem-bench-import-", dir=directory) as tmp:
        work = Path(tmp)
        start = time.perf_counter()
        imp, ev, schema = write_logs(work / "logs", impressions, events, kind=kind)
        generated = time.perf_counter() - start
        results = []
        options_of = {"numpy": {}, "duckdb": {"memory_limit": memory_limit, "threads": threads},
                      "spark": {"memory_limit": memory_limit, "master": master}}
        for engine in chosen:
            options = options_of[engine]
            results.append(run_engine(engine, imp, ev, schema, work / f"out-{engine}",
                                      impressions + events, **options))
        sizes = {"impressions_bytes": imp.stat().st_size, "events_bytes": ev.stat().st_size}
    report = {"benchmark": "import", "impressions": impressions, "events": events,
              "format": kind, "generate_seconds": round(generated, 2), **sizes,
              "results": results}
    if as_json:
        click.echo(json.dumps(report))
        return
    click.echo(f"{impressions} impressions + {events} events ({kind}, "
               f"{(sizes['impressions_bytes'] + sizes['events_bytes']) / 2**20:.1f} MiB)")
    for r in results:
        if "error" in r:
            click.echo(f"{r['engine']:8s} failed: {r['error']}")
            continue
        info = r.get("engine_info") or {}
        limit = (f"; memory limit {info['memory_limit']}" if "memory_limit" in info else
                 f"; driver heap {info['driver_memory']}" if "driver_memory" in info else "")
        click.echo(f"{r['engine']:8s} {r['rows_per_s']:12,.0f} rows/s "
                   f"{r['seconds']:8.2f} s  peak RSS {r['peak_rss_bytes'] / 2**20:8.1f} MiB"
                   f" ({r['measured']}{limit})")
