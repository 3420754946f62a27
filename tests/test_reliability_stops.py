"""Clean stops (gem_core.train.stop_signal, gem_core.cli.launch): SIGTERM or SIGINT to ``gem
train`` stops every rank after the same step with a checkpoint of it, exits with the signal's
status (143, 130) and one line naming the step and how to resume; the resumed run is
bit-identical to an uninterrupted one. No process of the run outlives it, nor a ``kill -9`` of
the launcher (whose ranks still save). The watcher bounds a stop: a second signal, or the end of
``train.stop_grace_s``, ends the process at once.

The runs are long (``train.steps`` far beyond what a test trains) and are signalled once their
``metrics.jsonl`` shows steps: the stop lands at whatever step it lands, the test reads which
from the message, and compares the resumed run with an uninterrupted one to two steps past it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from gem_core.checkpoint.digests import verify_files
from gem_core.checkpoint.layout import complete_checkpoints
from gem_core.testing.processes import alive, descendants

TESTS = Path(__file__).resolve().parent
ENV = {**os.environ, "TORCH_EXTENSIONS_DIR": os.environ.get(
    "TORCH_EXTENSIONS_DIR", str(TESTS.parent / ".cache/torch_extensions"))}
LONG = ["--set", "train.steps=100000", "--set", "train.batch_size=16",
        "--set", "data.eval_rows=64", "--set", "train.eval_batch_size=64",
        "--set", "train.warmup_steps=2", "--set", "train.eval_every=0",
        "--set", "train.checkpoint_every=0", "--set", "data.max_seq_len=16",
        "--set", "model.interaction_dims=[16]", "--set", "train.deterministic=true",
        "--no-progress"]
TWO_RANKS = ["--nproc-per-node", "2", "--sharding", "fsdp2"]
TIMEOUT_S = 300


def _exact_resume_helpers():
    """``_losses`` and ``assert_identical`` of tests/test_reliability_exact_resume.py."""
    spec = importlib.util.spec_from_file_location(
        "_exact_resume_helpers", TESTS / "test_reliability_exact_resume.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _launched(out: Path, launch: list[str], log: Path, *,
              reset_sigint: bool = False) -> Iterator[tuple[subprocess.Popen, dict[int, str]]]:
    """``gem train --out OUT LAUNCH LONG`` with stderr to ``log``; yields it and the record of
    its descendants (filled by :func:`_wait_for_steps`). Whatever is left at the end is killed."""
    # SIGINT as a terminal sends it: not ignored, even if this test runs in a background job.
    reset = (lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) if reset_sigint else None
    with open(log, "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "gem_core.cli.main", "train", "--out", str(out), *launch,
             *LONG], stdout=subprocess.DEVNULL, stderr=stderr, env=ENV, preexec_fn=reset)
    seen: dict[int, str] = {}
    try:
        yield process, seen
    finally:
        left = {**seen, **descendants(process.pid)}
        for pid in [process.pid, *alive(left)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.wait()


def _wait_for_steps(process: subprocess.Popen, out: Path, log: Path, steps: int,
                    seen: dict[int, str]) -> None:
    """Until ``metrics.jsonl`` holds ``steps`` whole lines (the ranks are training), recording
    the launcher's descendants as they appear."""
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        seen.update(descendants(process.pid))
        if metrics.exists() and metrics.read_bytes().count(b"\n") >= steps:
            seen.update(descendants(process.pid))
            return
        assert process.poll() is None, f"gem train ended early:\n{log.read_text()[-3000:]}"
        time.sleep(0.05)
    pytest.fail(f"no {steps} steps in {TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def _wait_until_gone(processes: dict[int, str], timeout: float = TIMEOUT_S) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := alive(processes)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


# -- what a stopped run left --------------------------------------------------------------------

def _only_checkpoint(run: Path) -> int:
    """The run's one complete checkpoint (none is periodic: the stop saved it), verified."""
    found = complete_checkpoints(run)
    assert len(found) == 1, found
    step, path = found[0]
    assert verify_files(path) == [], path
    assert not list((run / "checkpoints").glob(".tmp-*")), "a save was left unpublished"
    return step


def _check_resumes_exactly(gem, tmp_path: Path, stopped: Path, step: int,
                           launch: list[str]) -> None:
    """The stopped run resumed to ``step + 2`` equals an uninterrupted run to that step: every
    loss and gradient norm, and the final weights, optimizer, data position, RNG, counters."""
    helpers = _exact_resume_helpers()
    reference = tmp_path / "reference"
    until = ["--until-step", str(step + 2)]
    for out in (stopped, reference):
        result = gem("train", "--out", str(out), *launch, *until, *LONG, env=ENV)
        assert result.returncode == 0, result.stderr[-3000:]
    expected = helpers._losses(reference)
    assert [s for s, _, _ in expected] == list(range(1, step + 3))
    assert helpers._losses(stopped) == expected  # bit for bit
    from gem_core.checkpoint.checkpointer import read_checkpoint

    name = f"step-{step + 2:08d}"
    final = read_checkpoint(stopped / "checkpoints" / name)
    whole = read_checkpoint(reference / "checkpoints" / name)
    helpers.assert_identical(final["engine"], whole["engine"], "engine")
    for key in ("data", "rng", "totals", "guard", "step"):
        helpers.assert_identical(final["trainer"][key], whole["trainer"][key], key)


# -- one process --------------------------------------------------------------------------------

def test_sigterm_stops_one_process_with_a_checkpoint_and_it_resumes_exactly(gem, tmp_path):
    stopped, log = tmp_path / "stopped", tmp_path / "stopped.log"
    with _launched(stopped, [], log) as (process, seen):
        _wait_for_steps(process, stopped, log, 2, seen)
        process.send_signal(signal.SIGTERM)
        status = process.wait(timeout=TIMEOUT_S)
    stderr = log.read_text()
    assert status == 143, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    match = re.fullmatch(r"Error: stopped by SIGTERM after step (\d+): saved the checkpoint of "
                         rf"step \1 \({re.escape(str(stopped))}/checkpoints/step-0*\1\); run the "
                         rf"same command again \(gem train --out {re.escape(str(stopped))} "
                         r"\.\.\.\) to resume from it", last)
    assert match, last
    assert "SIGTERM received: the run stops at the end of this step" in stderr
    step = int(match.group(1))
    assert step >= 2 and _only_checkpoint(stopped) == step
    _check_resumes_exactly(gem, tmp_path, stopped, step, [])


def test_sigint_stops_one_process_with_a_checkpoint(tmp_path):
    """Ctrl-C: the same stop with status 130 (no "Aborted!" without a save)."""
    stopped, log = tmp_path / "stopped", tmp_path / "stopped.log"
    with _launched(stopped, [], log, reset_sigint=True) as (process, seen):
        _wait_for_steps(process, stopped, log, 2, seen)
        process.send_signal(signal.SIGINT)
        status = process.wait(timeout=TIMEOUT_S)
    stderr = log.read_text()
    assert status == 130, stderr[-3000:]
    assert "Aborted!" not in stderr and "KeyboardInterrupt" not in stderr
    match = re.search(r"Error: stopped by SIGINT after step (\d+): saved the checkpoint", stderr)
    assert match, stderr[-3000:]
    assert _only_checkpoint(stopped) == int(match.group(1))


# -- two ranks ----------------------------------------------------------------------------------

@pytest.mark.distributed
def test_sigterm_to_the_launcher_stops_both_ranks_at_one_step_and_it_resumes_exactly(
        gem, tmp_path):
    stopped, log = tmp_path / "stopped", tmp_path / "stopped.log"
    with _launched(stopped, TWO_RANKS, log) as (process, seen):
        _wait_for_steps(process, stopped, log, 2, seen)
        assert len(seen) >= 3, seen  # torchrun's agent and the two ranks
        process.send_signal(signal.SIGTERM)
        status = process.wait(timeout=TIMEOUT_S)
        left = alive(seen)  # the launcher waited for the agent, the agent for the ranks
    stderr = log.read_text()
    assert status == 143, stderr[-3000:]
    assert not left, f"processes of the run outlived it: {left}"
    last = stderr.strip().splitlines()[-1]
    match = re.fullmatch(r"Error: stopped by SIGTERM: every rank stopped after step (\d+) and its "
                         rf"checkpoint was saved \({re.escape(str(stopped))}/checkpoints/"
                         r"step-0*\1\); run the same command again .*", last)
    assert match, last
    step = int(match.group(1))
    assert f"stopped by SIGTERM after step {step}: saved the checkpoint" in stderr  # rank 0
    assert "Traceback" not in stderr, stderr[-3000:]
    assert step >= 2 and _only_checkpoint(stopped) == step
    shards = list((stopped / "checkpoints" / f"step-{step:08d}" / "engine").glob("*.distcp"))
    assert len(shards) == 2, shards  # both ranks wrote their shards of the same step
    _check_resumes_exactly(gem, tmp_path, stopped, step, TWO_RANKS)


@pytest.mark.distributed
def test_kill_9_of_the_launcher_leaves_no_process_and_the_ranks_still_save(tmp_path):
    """The agent dies with the launcher (PR_SET_PDEATHSIG, SIGKILL); the ranks get SIGTERM
    when the agent dies and stop as for a signal: a checkpoint, then exit."""
    stopped, log = tmp_path / "stopped", tmp_path / "stopped.log"
    with _launched(stopped, TWO_RANKS, log) as (process, seen):
        _wait_for_steps(process, stopped, log, 2, seen)
        assert len(seen) >= 3, seen
        process.kill()
        assert process.wait(timeout=TIMEOUT_S) == -signal.SIGKILL
        left = _wait_until_gone(seen, timeout=120)  # the ranks: train.stop_grace_s (25 s) at most
    assert not left, f"processes of the run outlived a kill -9 of gem train: {left}"
    stderr = log.read_text()
    match = re.search(r"stopped by SIGTERM after step (\d+): saved the checkpoint", stderr)
    assert match, stderr[-3000:]
    assert _only_checkpoint(stopped) == int(match.group(1))


# -- the watcher (in this process) --------------------------------------------------------------

class _Exits:
    """Stands in for ``os._exit``: records the status the watcher ends the process with."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.called = threading.Event()

    def __call__(self, status: int) -> None:
        self.status = status
        self.called.set()


def _wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def interactive_sigint():
    """SIGINT handled as in an interactive process (KeyboardInterrupt), even where this test
    runs as a background job, which ignores it (and so does StopSignals, then)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_signal_only_asks_to_stop_and_the_handlers_are_restored(interactive_sigint):
    from gem_core.train.stop_signal import StopSignals

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    exits = _Exits()
    with StopSignals(600, announce=False, exit=exits) as stop:
        assert stop.requested == 0.0
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt
        _wait_for(lambda: stop.signum is not None)
        assert stop.signum == signal.SIGINT and stop.requested == 1.0
    assert not exits.called.is_set()
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_second_signal_ends_the_process_at_once(monkeypatch, capfd):
    from gem_core.train import stop_signal

    monkeypatch.setattr(stop_signal, "REPEAT_AFTER_S", 0.05)
    exits = _Exits()
    with stop_signal.StopSignals(600, exit=exits) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        _wait_for(lambda: stop.received_at is not None)
        time.sleep(0.1)  # past REPEAT_AFTER_S: a second signal, not the same one again
        os.kill(os.getpid(), signal.SIGTERM)
        assert exits.called.wait(60)
    assert exits.status == 143
    assert "stopping at once (a second signal (SIGTERM))" in capfd.readouterr().err


def test_signals_close_together_are_one_stop(monkeypatch, interactive_sigint):
    """A scheduler that signals every process (a rank directly and through its agent)."""
    from gem_core.train import stop_signal

    monkeypatch.setattr(stop_signal, "REPEAT_AFTER_S", 600.0)
    exits = _Exits()
    with stop_signal.StopSignals(600, announce=False, exit=exits) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
    # Leaving joined the watcher after it had read every signal's byte.
    assert not exits.called.is_set() and stop.signum == signal.SIGTERM


@pytest.mark.parametrize("grace_s", [0.2, 0.0])
def test_the_grace_period_bounds_a_stop(grace_s, capfd):
    from gem_core.train.stop_signal import StopSignals

    exits = _Exits()
    with StopSignals(grace_s, exit=exits):
        os.kill(os.getpid(), signal.SIGTERM)  # and the run never reaches a step boundary
        assert exits.called.wait(60)
    assert exits.status == 143
    expected = ("the run did not stop within train.stop_grace_s = 0.2 s of SIGTERM"
                if grace_s else "SIGTERM with train.stop_grace_s = 0")
    assert expected in capfd.readouterr().err


def test_an_ignored_signal_stays_ignored():
    """``nohup``, or SIGINT of a job started with ``cmd &``: the run keeps ignoring it."""
    from gem_core.train.stop_signal import StopSignals

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopSignals(600, announce=False, exit=_Exits()):
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
