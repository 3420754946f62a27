"""``gem data import --engine spark`` (issue #28, item 1): Spark writes the requests the numpy path
writes (byte-identical files, the same split and report) on the logs the DuckDB engine is held
to (:mod:`gem_data.testing_logs`: 64-bit ids, multi-valued features, empty histories, events at
exactly the request time, a tie at the cut, missing values, strings, text users, side tables),
stops with the numpy path's errors, appends time windows as numpy does, refuses options it cannot
apply in one line, and ships a module spark-submit runs.

One SparkSession (``local[2]``, started by the engine's own :func:`start_session`) serves the
whole module: the JVM takes tens of seconds to start, and every import here finds it running.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from gem_core.errors import GemDataError
from gem_data.importer import import_command, import_logs
from gem_data.testing_logs import (
    BAD_CASES,
    GOOD,
    RULES,
    compare_engines,
    engine_errors,
    generated_logs,
    missing_value_logs,
)

pytest.importorskip("pyspark")

DOC = Path(__file__).resolve().parents[3] / "docs" / "byod.md"
ENGINES = ("numpy", "spark")
OPTIONS = {"spark": {"master": "local[2]"}}


@pytest.fixture(scope="module", autouse=True)
def spark(tmp_path_factory):
    if shutil.which("java") is None and "JAVA_HOME" not in os.environ:
        pytest.skip("Spark needs Java 17 or later, and there is none here")
    from gem_data.import_spark_session import start_session

    # Two shuffle partitions: the logs here are tiny, and each partition is a task to schedule.
    session, started = start_session("local[2]", None, tmp_path_factory.mktemp("spark"),
                                     {"spark.sql.shuffle.partitions": "2"})
    yield session
    if started:
        session.stop()


def compare(tmp_path: Path, imp: Path, ev: Path, schema_file: Path, **options):
    return compare_engines(tmp_path, imp, ev, schema_file, engines=ENGINES,
                           engine_options=OPTIONS, **options)


def test_spark_writes_the_requests_numpy_writes(tmp_path):
    """CSV logs with a text request id (Parquet logs keyed by user and time: the windows
    test, and the walkthrough)."""
    imp, ev, schema_file = generated_logs(tmp_path, "csv", request_id=True)
    a, b = compare(tmp_path, imp, ev, schema_file)
    assert a.info["split"]["tie_at_cut"]["requests"] > 1  # the tie stays on one side
    assert b.info["engine"]["master"] == "local[2]"
    assert b.info["engine"]["version"] == "4.3.0"


def test_spark_agrees_on_missing_values_strings_and_text_users(tmp_path):
    """Every missing policy, hash and vocabulary strings, text user ids (numbered by their
    hash in Spark's Python workers), read two rows a block."""
    imp, ev, schema_file, _ = missing_value_logs(tmp_path)
    a, _ = compare(tmp_path, imp, ev, schema_file, blocks={"block_rows": 2})
    assert a.info["requests"]["user_ids"] == "text"
    assert a.info["requests"]["dropped_impressions"] == 2


def test_the_taobao_walkthrough_on_spark_prints_what_the_page_shows(tmp_path, monkeypatch):
    """No request id, side tables, vocabularies, NULLs given defaults, from the command line:
    the numpy path's files and the page's printed report."""
    page = DOC.read_text()
    blocks = dict(re.findall(r"<!-- byod-taobao:(\S+) -->\n```\w*\n(.*?)```", page, flags=re.S))
    for name in ("raw_sample.csv", "ad_feature.csv", "user_profile.csv", "behavior_log.csv",
                 "taobao.toml"):
        (tmp_path / name).write_text(blocks[name])
    monkeypatch.chdir(tmp_path)
    numpy = import_logs("raw_sample.csv", "behavior_log.csv", "taobao.toml", "numpy")
    command = blocks["command"].split()[3:]
    result = CliRunner().invoke(import_command, command + ["--engine", "spark",
                                                           "--master", "local[2]"])
    assert result.exit_code == 0, result.output
    printed = re.search(r"It prints:\n\n```\n(.*?)```", page, flags=re.S).group(1)
    assert result.output == printed
    out = tmp_path / command[command.index("--out") + 1]
    for (entry,) in numpy.splits.values():
        assert (out / entry.path).read_bytes() == (tmp_path / "numpy" / entry.path).read_bytes()


# -- errors: the numpy path's ---------------------------------------------------------------


@pytest.mark.parametrize("case", ["id outside its table", "users differ in a request",
                                  "times differ in a request", "context differs in a request",
                                  "context bag sizes differ", "dense differs in a request"])
def test_spark_stops_with_the_numpy_paths_errors(tmp_path, case):
    """A value refused while the log is staged, and every check over whole requests (these
    run in Spark and name the row numpy names)."""
    messages = engine_errors(tmp_path, BAD_CASES[case], engines=ENGINES, engine_options=OPTIONS)
    assert messages["spark"] == messages["numpy"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_ids_that_collide_are_refused_as_numpy_refuses_them(tmp_path, monkeypatch):
    """Spark's workers compute request ids and user numbers with the function the driver has
    (here one that gives every key id 0, then every user number 0)."""
    from gem_data import import_requests

    schema = RULES.replace("[import]\n", '[import]\nrequest_columns = ["user_id", "timestamp"]\n')
    monkeypatch.setattr(import_requests, "fold_ids",
                        lambda values: np.zeros(len(values[0]), dtype=np.int64))
    messages = engine_errors(tmp_path / "ids", GOOD, schema=schema, engines=ENGINES,
                             engine_options=OPTIONS)
    assert "have the same 64-bit request id 0" in messages["numpy"]
    assert messages["spark"] == messages["numpy"]
    monkeypatch.undo()
    monkeypatch.setattr(import_requests, "text_numbers",
                        lambda texts: np.zeros(len(texts), dtype=np.int64))
    messages = engine_errors(tmp_path / "users", GOOD, engines=ENGINES, engine_options=OPTIONS)
    assert "users 'u1' and 'u2' have the same 64-bit user number 0" in messages["numpy"]
    assert messages["spark"] == messages["numpy"]


# -- time windows ----------------------------------------------------------------------------


def test_spark_appends_the_windows_numpy_appends(tmp_path):
    """Two windows, the second appended: the same request files byte for byte and the same
    history tails (the first window's carried into the second's histories)."""
    imp, ev, schema_file = generated_logs(tmp_path, "parquet", request_id=False)
    schema_file.write_text(schema_file.read_text().replace("eval_fraction = 0.25",
                                                           "eval_fraction = 0"))
    logs = {}
    for name, low, high in (("A", 0, 250), ("B", 251, 10**6)):
        logs[name] = []
        for path in (imp, ev):
            table = pq.read_table(path)
            times = table.column("timestamp")
            window = table.filter(pc.and_(pc.greater_equal(times, low), pc.less_equal(times, high)))
            pq.write_table(window, tmp_path / f"{name}-{path.name}")
            logs[name].append(tmp_path / f"{name}-{path.name}")
    for engine in ENGINES:
        for i, name in enumerate(logs):
            import_logs(*logs[name], schema_file, tmp_path / engine, engine=engine, window=name,
                        append=i > 0, **({"master": "local[2]", "block_rows": 4}
                                         if engine == "spark" else {}))
    files = sorted(str(p.relative_to(tmp_path / "numpy"))
                   for p in (tmp_path / "numpy").rglob("*.parquet"))
    assert files == sorted(str(p.relative_to(tmp_path / "spark"))
                           for p in (tmp_path / "spark").rglob("*.parquet"))
    assert "windows/B/history_tail.parquet" in files
    for path in files:
        if "history_tail" in path:
            assert pq.read_table(tmp_path / "numpy" / path).equals(
                pq.read_table(tmp_path / "spark" / path)), path
        else:
            assert (tmp_path / "numpy" / path).read_bytes() == \
                (tmp_path / "spark" / path).read_bytes(), path
    # A window whose events are not all later than B's last time is refused, naming the row.
    messages = {}
    for engine in ENGINES:
        with pytest.raises(GemDataError) as error:
            import_logs(logs["B"][0], imp.with_name("ev.parquet"), schema_file, tmp_path / engine,
                        engine=engine, window="C", append=True, **OPTIONS.get(engine, {}))
        messages[engine] = str(error.value).replace(str(tmp_path / engine), "OUT")
    assert "is not after" in messages["numpy"] and messages["spark"] == messages["numpy"]


# -- options and the spark-submit entry ------------------------------------------------------


def test_options_spark_cannot_apply_are_refused_in_one_line(tmp_path):
    imp, ev, schema_file = generated_logs(tmp_path, "csv")
    common = ["--impressions", str(imp), "--events", str(ev), "--schema", str(schema_file),
              "--out", str(tmp_path / "out")]
    for extra, expected in (
            (["--engine", "spark", "--threads", "2"],
             "Error: --threads applies to --engine duckdb; Spark's cores are its master's"),
            (["--master", "local[2]"],
             "Error: --master applies to --engine spark; the numpy engine holds both logs"),
            (["--engine", "spark", "--memory-limit", "2 parsecs"],
             "Error: --memory-limit '2 parsecs' is not a size (write it as 2GB"),
            (["--engine", "spark", "--master", "local[3]"],
             "Error: --master local[3]: this process already runs Spark on local[2]"),
            (["--engine", "spark", "--memory-limit", "2GB"],
             "Error: --memory-limit 2GB: this process already runs Spark (on local[2])")):
        result = CliRunner().invoke(import_command, common + extra)
        assert result.exit_code == 1, result.output
        assert result.output.startswith(expected) and result.output.count("\n") == 1, \
            result.output
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_the_module_spark_submit_runs_is_gem_data_import_on_spark():
    module = [sys.executable, "-m", "gem_data.spark_submit"]
    shown = subprocess.run([*module, "--help"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "--impressions" in shown.stdout and "--master" in shown.stdout
    refused = subprocess.run([*module, "--engine", "duckdb"], capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 1
    assert refused.stderr.strip() == "Error: --engine: this entry point always runs --engine spark"


def test_without_pyspark_the_error_says_what_to_install(tmp_path, monkeypatch):
    imp, ev, schema_file = generated_logs(tmp_path, "csv")
    monkeypatch.setitem(sys.modules, "pyspark.sql", None)  # as if it were not installed
    with pytest.raises(GemDataError, match=r"--engine spark needs the pyspark package and Java "
                                           r"17 or later: pip install 'gem-data\[spark\]'"):
        import_logs(imp, ev, schema_file, tmp_path / "out", engine="spark")
    assert not (tmp_path / "out").exists()


def test_spark_failures_are_one_line_errors_naming_what_to_change(tmp_path):
    from gem_data.import_spark_session import describe_failure, spark_errors

    oom = describe_failure(RuntimeError("An error occurred while calling o9.parquet.\n: "
                                        "org.apache.spark.SparkException: Job aborted\n\tat x\n"
                                        "Caused by: java.lang.OutOfMemoryError: Java heap space"),
                           "1GB", tmp_path)
    assert oom.startswith("Spark ran out of memory (--memory-limit 1GB, the driver's heap in "
                          "local mode): raise --memory-limit")
    assert "\n" not in oom
    from pyspark.errors import PySparkRuntimeError

    with pytest.raises(GemDataError, match=r"^Spark \(PySparkRuntimeError\): .*--temp-dir\)$"):
        with spark_errors(None, tmp_path):
            raise PySparkRuntimeError(errorClass="JAVA_GATEWAY_EXITED", messageParameters={})


def test_the_bench_counts_the_memory_of_child_processes():
    """gem bench import's measure for Spark: the driver with its JVM and Python workers (here,
    a child process holding 200 MiB)."""
    from gem_data.process_memory import TreePeak

    hold = ("import sys, time\nheld = bytearray(200 << 20)\nprint('held', flush=True)\n"
            "time.sleep(0.5)\n")
    with TreePeak(0.05) as tree:
        child = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline() == "held\n"
        tree.sample()
        child.wait(timeout=60)
    assert tree.parts["other"] >= 200 << 20 and tree.peak >= (200 << 20) + tree.parts["self"] // 2
