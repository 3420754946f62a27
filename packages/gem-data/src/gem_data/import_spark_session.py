"""The SparkSession of ``gem data import --engine spark`` (:mod:`gem_data.import_spark`), and
Spark's failures as one-line errors.

A session already running in the process is used as it is: the one ``spark-submit`` starts
(its ``--master``, memory and cluster settings), or a test's. Otherwise one is started for the
import and stopped after it: ``--master`` (default ``local[*]``), ``--memory-limit`` as the
driver's heap (``spark.driver.memory``: in local mode the one JVM holding every task), Spark's
scratch space (``spark.local.dir``) in the import's work directory, the Python workers on this
interpreter (where gem-data is installed: they run the id hashing), and the JVM's own output
(its start-up banner, log4j's warnings, the workers' output) in ``spark.log`` there, not in the
user's terminal.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterator

#: The PySpark release gem-data is tested with (``gem-data[spark]`` pins it).
PYSPARK_VERSION = "4.3.0"

SUBMITTED = "PYSPARK_GATEWAY_PORT"
"""Set in a Python program that spark-submit runs (the JVM it started listens there)."""

_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

# log4j2: warnings and errors to the JVM's stderr, which start_session points at spark.log.
_LOG4J2 = """rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = stderr
appender.stderr.type = Console
appender.stderr.name = stderr
appender.stderr.target = SYSTEM_ERR
appender.stderr.layout.type = PatternLayout
appender.stderr.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex
"""


def spark_memory(limit: str) -> str:
    """``--memory-limit`` (DuckDB's syntax: ``2GB``, ``512MB``, ``1.5GiB``; Spark's ``2g`` too)
    as a ``spark.driver.memory`` in whole MiB (``1907m``)."""
    from gem_core.errors import GemDataError

    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", limit)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise GemDataError(f"--memory-limit {limit!r} is not a size (write it as 2GB, 512MB or "
                           "1.5GiB); with --engine spark it is the driver's heap")
    return f"{max(1, int(float(match.group(1)) * _UNITS[unit]) // 2**20)}m"


def _import_pyspark() -> Any:
    from gem_core.errors import GemDataError

    try:
        import pyspark.sql
    except ImportError:
        raise GemDataError("--engine spark needs the pyspark package and Java 17 or later: pip "
                           f"install 'gem-data[spark]' (pyspark=={PYSPARK_VERSION})") from None
    return pyspark.sql


def start_session(master: str | None, memory_limit: str | None, work: Path,
                  conf: dict[str, str] | None = None) -> tuple[Any, bool]:
    """``(session, started)``: the SparkSession running in this process (``started`` False),
    else a new one (True) on ``master`` (None: ``local[*]``) with the driver's heap
    ``memory_limit`` (None: Spark's default, 1 GiB), its scratch space and log in ``work``;
    ``conf``: more of Spark's settings for a new session."""
    from gem_core.errors import GemDataError

    memory = spark_memory(memory_limit) if memory_limit is not None else None  # checked first
    sql = _import_pyspark()
    running = sql.SparkSession.getActiveSession()
    if running is not None:
        _refuse_settings(running.sparkContext.master, master, memory_limit)
        return running, False
    if SUBMITTED in os.environ:  # spark-submit started the JVM with its own settings
        _refuse_settings("spark-submit's master", master, memory_limit)
        with spark_errors(memory_limit, work):
            return sql.SparkSession.builder.appName("gem data import").getOrCreate(), True
    work.mkdir(parents=True, exist_ok=True)
    (work / "log4j2.properties").write_text(_LOG4J2)
    builder = sql.SparkSession.builder.appName("gem data import").master(master or "local[*]")
    settings = {"spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false",
                "spark.local.dir": str(work / "scratch"),
                "spark.driver.extraJavaOptions":
                    f"-Dlog4j2.configurationFile=file:{work / 'log4j2.properties'}",
                **({"spark.driver.memory": memory} if memory else {}), **(conf or {})}
    for key, value in settings.items():
        builder = builder.config(key, value)
    # py4j says at INFO when each connection closes: not for the user's terminal.
    logging.getLogger("py4j").setLevel(logging.WARNING)
    # The Python workers run gem-data's functions: this interpreter has it (PySpark reads the
    # workers' interpreter from this variable when the session starts; python3 otherwise).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    try:
        with _output_to(work / "spark.log"):  # the JVM keeps these as its stdout and stderr
            session = builder.getOrCreate()
    except Exception as error:  # the JVM did not start: no Java, a bad setting, no memory
        said = _last_line(work / "spark.log")
        settings = f"--master {master or 'local[*]'}, --memory-limit {memory_limit or 'not given'}"
        if said:
            raise GemDataError(f"Spark did not start ({settings}): {said}") from None
        raise GemDataError(f"Spark did not start ({settings}): {_first_line(error)}; it needs "
                           "Java 17 or later, on PATH or in JAVA_HOME") from None
    return session, True


def _refuse_settings(running: str, master: str | None, memory_limit: str | None) -> None:
    """A session already started cannot take another master or heap: say so rather than
    ignore them."""
    from gem_core.errors import GemDataError

    if master is not None and master != running:
        raise GemDataError(f"--master {master}: this process already runs Spark on {running} "
                           "(spark-submit's, or another import's); leave --master out, or give "
                           "it to spark-submit")
    if memory_limit is not None:
        raise GemDataError(f"--memory-limit {memory_limit}: this process already runs Spark "
                           f"(on {running}), whose memory was set when it started; leave "
                           "--memory-limit out, or give spark-submit --driver-memory")


@contextlib.contextmanager
def _output_to(path: Path) -> Iterator[None]:
    """File descriptors 1 and 2 pointed at ``path`` while the block runs: a process started
    inside (Spark's JVM) writes there for its whole life, this one writes where it did."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(log, 1)
        os.dup2(log, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, log):
            os.close(fd)


def _last_line(path: Path) -> str:
    """The last line of a log that is not a stack frame ('' if there is none)."""
    if not path.is_file():
        return ""
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines()
             if line.strip() and not line.strip().startswith("at ")]
    return lines[-1] if lines else ""


def _first_line(error: BaseException) -> str:
    """The line of a Spark error that says what went wrong: the error a Python traceback ends
    with (a Python worker's), else the first line naming an exception (the JVM's), else the
    first line."""
    lines = [line.strip().lstrip(": ") for line in str(error).splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"(?:[\w$]+\.)*[\w$]*(?:Error|Exception)\b",
                                                line)]
    if named:
        return named[-1] if "Traceback (most recent call last)" in str(error) else named[0]
    return lines[0] if lines else type(error).__name__


def describe_failure(error: BaseException, memory_limit: str | None, work: Path) -> str:
    """A Spark failure (a job that failed, the JVM out of memory, a full disk) as one line
    naming the engine and what to change."""
    text = str(error)
    if "OutOfMemoryError" in text or "Java heap space" in text:
        return (f"Spark ran out of memory (--memory-limit {memory_limit or 'not given'}, the "
                "driver's heap in local mode): raise --memory-limit, or run on a cluster with "
                f"--master ({_first_line(error)})")
    if "No space left on device" in text:
        return (f"Spark ran out of disk space in its work directory {work}: point --temp-dir "
                f"at a disk with room ({_first_line(error)})")
    return f"Spark ({type(error).__name__}): {_first_line(error)}; its work directory was " \
           f"{work} (--temp-dir)"


@contextlib.contextmanager
def spark_errors(memory_limit: str | None, work: Path) -> Iterator[None]:
    """Spark's and py4j's exceptions raised in the block as a GemDataError
    (:func:`describe_failure`); gem-data's own errors pass as they are."""
    from py4j.protocol import Py4JError
    from pyspark.errors import PySparkException

    from gem_core.errors import GemDataError

    try:
        yield
    except (PySparkException, Py4JError) as error:
        raise GemDataError(describe_failure(error, memory_limit, work)) from None
