"""Issue #27's acceptance test on a data set a user would make: raw logs of three time windows
imported with ``gem data import --window`` and then ``--append`` twice, trained in time order
once over all three windows and, separately, window by window (train, append the next window's
logs, run the same ``gem train`` again, which continues). The two give the same losses, the same
progressive evaluations and the same summary, bit for bit (``train.deterministic = true``).

``tests/test_streaming.py`` checks the same on a data set grown by a test helper;
``packages/gem-data/tests/test_import_windows.py`` that the appended windows hold, request for
request, what one import of all the logs gives."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from click.testing import CliRunner

from gem_core.testing.runs import jsonl_records, step_losses
from gem_data.manifest import read_manifest
from gem_data.testing import hashed_log_schema

SCHEMA = hashed_log_schema(max_seq_len=8, eval_fraction=0)

WINDOWS = {"A": (1000, 1999), "B": (2000, 2999), "C": (3000, 3999)}
"""Each window's time range (seconds): the logs are cut by these."""

REQUESTS = 96  # per window, in batches of 32: three steps a window
USERS = 24

TRAIN = ("data.source=parquet", "data.order=time", "data.options={}", "train.batch_size=32",
         "train.steps=1000", "train.warmup_steps=1", "data.max_seq_len=8",
         "model.interaction_dims=[16]", "train.eval_batch_size=128",
         "train.deterministic=true")  # exact comparisons: deterministic algorithms on CPU


def log_rows() -> tuple[list[tuple], list[tuple]]:
    """``(impressions, events)``: impressions (user, time, ad, topics, seg, score, click), events
    (user, time, ad, topics); every user's events spread over the three windows, so appended
    windows' histories begin in earlier ones."""
    rng = np.random.default_rng(27)
    events = []
    for time in range(1000, 4000, 7):
        user, ad = int(rng.integers(1, USERS + 1)), int(rng.integers(1, 400))
        events.append((user, time, ad, [ad % 31, 40 + ad % 5][: 1 + ad % 2]))
    impressions = []
    for low, _ in WINDOWS.values():
        for r in range(REQUESTS):  # one request per (user, time): every time distinct
            user, time = int(rng.integers(1, USERS + 1)), low + 10 * r + 5
            score = float(rng.random())  # the request's context: the same on its impressions
            for _ in range(1 + r % 3):
                ad = int(rng.integers(1, 400))
                click = int(rng.random() < (0.6 if (ad + user) % 3 == 0 else 0.15))
                impressions.append((user, time, ad, [ad % 31], [user % 5], score, click))
    return impressions, events


def write_logs(directory: Path, impressions: list[tuple], events: list[tuple]) -> list[str]:
    """The logs as Parquet files in ``directory``; the import command's log arguments."""
    directory.mkdir(parents=True)
    pq.write_table(pa.table({
        "user_id": pa.array([r[0] for r in impressions], pa.uint64()),
        "timestamp": [r[1] for r in impressions],
        "ad": pa.array([r[2] for r in impressions], pa.uint64()),
        "topics": pa.array([r[3] for r in impressions], pa.list_(pa.uint64())),
        "seg": pa.array([r[4] for r in impressions], pa.list_(pa.uint64())),
        "score": [r[5] for r in impressions], "click": [r[6] for r in impressions]}),
        directory / "impressions.parquet")
    pq.write_table(pa.table({
        "user_id": pa.array([r[0] for r in events], pa.uint64()),
        "timestamp": [r[1] for r in events],
        "ad": pa.array([r[2] for r in events], pa.uint64()),
        "topics": pa.array([r[3] for r in events], pa.list_(pa.uint64()))}),
        directory / "events.parquet")
    return ["--impressions", str(directory / "impressions.parquet"),
            "--events", str(directory / "events.parquet")]


def window_logs(tmp_path: Path) -> dict[str, list[str]]:
    """Each window's logs, cut from one log by time, as the import command's arguments."""
    impressions, events = log_rows()
    return {name: write_logs(tmp_path / "logs" / name,
                             [r for r in impressions if low <= r[1] <= high],
                             [r for r in events if low <= r[1] <= high])
            for name, (low, high) in WINDOWS.items()}


def _import(logs: list[str], schema: Path, out: Path, window: str, append: bool):
    """``gem data import ... --window WINDOW [--append]``, in this process (the command the
    ``gem`` executable runs; a subprocess would import everything again, for seconds)."""
    from gem_core.cli.main import cli

    done = CliRunner().invoke(cli, [
        "data", "import", *logs, "--schema", str(schema), "--out", str(out), "--window", window,
        "--row-group-rows", "16", *(["--append"] if append else [])])
    assert done.exit_code == 0, done.output[-3000:]
    assert f"wrote window {window!r} to {out}" in done.output


def _train(gem, run: Path, data: Path):
    sets = [arg for item in TRAIN + (f"data.path={data}",) for arg in ("--set", item)]
    # one thread: on a small shared machine two threads spin against each other for four times
    # the CPU; both runs use the same
    done = gem("train", "--preset", "tiny", "--out", str(run), "--no-progress", *sets,
               env={"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_one_run_on_an_appended_import_equals_a_run_continued_after_each_append(tmp_path, gem):
    logs = window_logs(tmp_path)
    schema = tmp_path / "schema.toml"
    schema.write_text(SCHEMA)

    whole = tmp_path / "whole"  # three windows, appended before training
    for i, window in enumerate(WINDOWS):
        _import(logs[window], schema, whole, window, append=i > 0)
    one_go = tmp_path / "one-go"
    done = _train(gem, one_go, whole)
    assert "windows trained: 3 of 3" in done.stdout

    growing, continued = tmp_path / "growing", tmp_path / "continued"
    for i, window in enumerate(WINDOWS):  # append a window, run the same command again
        _import(logs[window], schema, growing, window, append=i > 0)
        done = _train(gem, continued, growing)  # the same --out: continues, no flag needed
        assert f"windows trained: {i + 1} of {i + 1}" in done.stdout

    # the same windows, file for file (so the runs read the same requests)
    a, b = read_manifest(whole), read_manifest(growing)
    assert [w.name for w in a.windows] == [w.name for w in b.windows] == list(WINDOWS)
    assert [w.info["requests"]["requests"] for w in a.windows] == [REQUESTS] * 3
    assert [(e.path, e.sha256) for e in a.splits["train"]] == \
        [(e.path, e.sha256) for e in b.splits["train"]]

    losses = step_losses(one_go)
    assert [step for step, _ in losses] == list(range(1, 10))  # three steps a window
    assert all(np.isfinite(loss) for _, loss in losses)
    assert step_losses(continued) == losses
    evals = jsonl_records(one_go / "eval.jsonl")
    assert [e["window"] for e in evals] == ["B", "C"]
    assert jsonl_records(continued / "eval.jsonl") == evals
    one, grown = (json.loads((run / "summary.json").read_text()) for run in (one_go, continued))
    assert one["progressive"]["windows_trained"] == one["progressive"]["windows_total"] == 3
    assert [w["step"] for w in one["progressive"]["windows"]] == [3, 6]
    assert grown["run"]["resumed_from"] == 6  # the last run continued from window B's end
    assert grown["progressive"] == one["progressive"]
    assert grown["eval"] == one["eval"]
