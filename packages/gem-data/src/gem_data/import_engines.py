"""The engines of ``gem data import`` besides numpy, opened one way for an import
(:mod:`gem_data.importer`) and for a time window (:mod:`gem_data.import_append`): DuckDB
(:mod:`gem_data.import_duckdb`) and Spark (:mod:`gem_data.import_spark`). Both give a run with
``prepare()`` (the report), ``write(writer, where, row_group_rows)`` and ``engine_info()``, used
as a context manager; and which of the run options (``--memory-limit``, ...) each engine takes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ENGINES = ("numpy", "duckdb", "spark")
"""The engines of ``gem data import`` (``--engine``)."""

#: Per run option, the engines that take it.
OPTION_ENGINES = {"memory_limit": ("duckdb", "spark"), "temp_dir": ("duckdb", "spark"),
                  "threads": ("duckdb",), "master": ("spark",)}

_WHY_NOT = {"numpy": "the numpy engine holds both logs in memory",
            "duckdb": "DuckDB runs inside this process",
            "spark": "Spark's cores are its master's (--master local[4]: four)"}


def refuse_options(engine: str, run_options: dict[str, Any]) -> None:
    """Refuse the run options given that ``engine`` does not take, saying which engines do."""
    from gem_core.errors import GemDataError

    given = [name for name, engines in OPTION_ENGINES.items()
             if run_options.get(name) is not None and engine not in engines]
    if not given:
        return
    by_engines: dict[tuple[str, ...], list[str]] = {}
    for name in given:
        by_engines.setdefault(OPTION_ENGINES[name], []).append(f"--{name.replace('_', '-')}")
    parts = [f"{' and '.join(names)} {'applies' if len(names) == 1 else 'apply'} to --engine "
             f"{' or '.join(engines)}" for engines, names in by_engines.items()]
    raise GemDataError(f"{'; '.join(parts)}; {_WHY_NOT[engine]}")


def open_run(engine: str, impressions: Any, events: Any, schema: Any, options: Any, *,
             vocabularies: dict[str, Any] | None, earlier: Any, run_options: dict[str, Any],
             staging: Path) -> Any:
    """The run of ``engine`` (duckdb or spark) over the logs; its work directory is in
    ``--temp-dir``, by default the staging directory ``staging``."""
    temp_dir = staging if run_options.get("temp_dir") is None else run_options["temp_dir"]
    common = {"vocabularies": vocabularies, "earlier": earlier, "temp_dir": temp_dir,
              **{k: run_options.get(k) for k in ("memory_limit", "block_rows", "block_bytes")}}
    if engine == "duckdb":
        from gem_data.import_duckdb import DuckDBImport

        return DuckDBImport(impressions, events, schema, options,
                            threads=run_options.get("threads"), **common)
    if engine == "spark":
        from gem_data.import_spark import SparkImport

        return SparkImport(impressions, events, schema, options,
                           master=run_options.get("master"), **common)
    raise AssertionError(f"{engine!r} is not an engine with runs")


def window_functions(engine: str) -> tuple[Any, Any]:
    """``(history_tail, last_time)`` of ``engine`` for a window: ``history_tail(run, rows)``,
    the tail of the window ``run`` wrote, a reader of batches of about ``rows`` events;
    ``last_time(run)``, the window's last time."""
    if engine == "duckdb":
        from gem_data.import_duckdb_windows import history_tail, last_time
    else:
        from gem_data.import_spark_windows import history_tail, last_time
    return history_tail, last_time
