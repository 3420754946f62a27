"""Run-directory reliability end to end (issue #19): one trainer per directory, a persistent
fault that stops after ``train.max_rollbacks``, a torn log line, ``--fresh``, resuming on other
data, ``train.steps`` below the checkpoint and a full disk during a checkpoint."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from gem_core.cli.main import CATALOG, cli
from gem_core.config import load_config
from gem_core.errors import GemConfigError, GemRunError
from gem_core.train.run_lock import LOCK_NAME
from gem_core.train.trainer import train

SMALL = ["train.batch_size=32", "data.eval_rows=128", "train.eval_batch_size=128",
         "train.warmup_steps=1", "train.eval_every=0", "data.max_seq_len=24",
         "model.interaction_dims=[16]", "model.num_layers=1"]


def _config(*overrides: str):
    return load_config(overrides=[*SMALL, *overrides])


def _steps(run: Path, name: str = "metrics.jsonl") -> list[int]:
    return [json.loads(line)["step"] for line in (run / name).read_text().splitlines()]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A run of 2 steps with its step-2 checkpoint; tests work on copies."""
    run = tmp_path_factory.mktemp("finished") / "run"
    train(_config("train.steps=2"), CATALOG.plugins, run, progress=False)
    return run


def _copy(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy


def test_a_second_trainer_is_refused_while_the_first_runs(tmp_path):
    run = tmp_path / "run"
    # The first trainer has far more steps than the test lets it run: it must still hold the
    # lock when the second starts, however fast the machine (12 steps once finished in the
    # second's start-up time on an idle machine). It is stopped once the second was refused.
    args = [f"--set={o}" for o in SMALL] + ["--set=train.steps=100000",
                                            "--set=train.eval_every=4",
                                            "--set=train.checkpoint_every=0"]
    first = subprocess.Popen([sys.executable, "-m", "gem_core.cli.main", "train", "--out",
                              str(run), "--no-progress", *args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while f'"pid": {first.pid},' not in _read(run / LOCK_NAME):
            assert first.poll() is None, first.communicate()[1][-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(1.0)  # the second trainer starts a second after the first took the lock
        second = CliRunner().invoke(cli, ["train", "--out", str(run), "--no-progress", *args])
        assert first.poll() is None, first.communicate()[1][-3000:]
        assert second.exit_code == 1
        assert f"is in use by another trainer (pid {first.pid} on host" in second.output
        assert "Traceback" not in second.output
        # Let the first log a few more steps after the refusal, then stop it.
        logged = len(_complete_lines(run / "metrics.jsonl"))
        while len(_complete_lines(run / "metrics.jsonl")) < logged + 2:
            assert first.poll() is None, first.communicate()[1][-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        first.kill()
        first.communicate(timeout=600)
    steps = [json.loads(line)["step"] for line in _complete_lines(run / "metrics.jsonl")]
    assert steps == list(range(1, len(steps) + 1))  # every step once
    evals = [json.loads(line)["step"] for line in _complete_lines(run / "eval.jsonl")]
    assert evals == list(range(4, 4 * len(evals) + 1, 4))
    assert len(list((run / "tensorboard").iterdir())) == 1


def _complete_lines(path: Path) -> list[str]:
    """The lines of a JSON-lines file being appended to, without a last line still being
    written (killed mid-write, or read between two writes)."""
    text = _read(path)
    return text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_a_persistent_fault_stops_after_max_rollbacks(tmp_path):
    # lr 1e30: the step after every rollback blows the weights up, the next ones are NaN.
    config = _config("train.steps=50", "train.lr=1e30", "train.checkpoint_every=2",
                     "train.max_bad_steps=2", "train.max_rollbacks=2")
    started = time.perf_counter()
    with pytest.raises(GemRunError) as stopped:
        train(config, CATALOG.plugins, tmp_path, progress=False)
    elapsed = time.perf_counter() - started
    message = str(stopped.value)
    assert "train.max_rollbacks = 2" in message and "the fault persists" in message
    assert message.count("rolled back to step") == 2, message
    assert "3. steps " in message and "non-finite" in message
    print(f"stopped after {elapsed:.1f} s: {message}")


def test_a_torn_last_line_is_dropped_on_resume(finished_run, tmp_path, caplog):
    run = _copy(finished_run, tmp_path)
    for name in ("metrics.jsonl", "eval.jsonl"):
        with open(run / name, "a") as handle:
            handle.write('{"step": 3, "loss": 0.6')  # killed mid-write
    with caplog.at_level(logging.WARNING):
        train(_config("train.steps=3"), CATALOG.plugins, run, progress=False)
    assert caplog.text.count("torn by an interrupted write") == 2
    assert _steps(run) == [1, 2, 3]
    assert _steps(run, "eval.jsonl") == [2, 3]


def test_a_restart_without_a_checkpoint_logs_each_step_once(finished_run, tmp_path):
    run = _copy(finished_run, tmp_path)
    shutil.rmtree(run / "checkpoints")  # killed before its first save: logs but no checkpoint
    train(_config("train.steps=2"), CATALOG.plugins, run, progress=False)
    assert _steps(run) == [1, 2]
    assert _steps(run, "eval.jsonl") == [2]


def test_fresh_starts_logs_summary_and_tensorboard_anew(finished_run, tmp_path):
    run = _copy(finished_run, tmp_path)
    (run / "summary.json").write_text("{}")  # were it left, the failed fresh run below shows it
    with pytest.raises(GemConfigError):
        train(_config("train.steps=2", "backends.attention=no-such-backend"),
              CATALOG.plugins, run, fresh=True, progress=False)
    assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]
    train(_config("train.steps=2"), CATALOG.plugins, run, fresh=True, progress=False)
    assert _steps(run) == [1, 2]
    assert _steps(run, "eval.jsonl") == [2]
    assert len(list((run / "tensorboard").iterdir())) == 1
    assert json.loads((run / "summary.json").read_text())["run"]["resumed_from"] == 0


def test_another_seed_is_refused_unless_allowed(finished_run, tmp_path):
    run = _copy(finished_run, tmp_path)
    with pytest.raises(GemConfigError, match=r"trained on other data .*seed: 0 -> 1.*"
                                             r"--allow-data-change"):
        train(_config("train.steps=3", "train.seed=1"), CATALOG.plugins, run, progress=False)
    result = train(_config("train.steps=3", "train.seed=1"), CATALOG.plugins, run,
                   progress=False, allow_data_change=True)
    assert result.summary["run"]["resumed_from"] == 2 and _steps(run) == [1, 2, 3]


def test_steps_below_the_checkpoint_are_refused_and_config_kept(finished_run, tmp_path):
    run = _copy(finished_run, tmp_path)
    before = (run / "config.toml").read_bytes()
    with pytest.raises(GemConfigError, match=r"step-00000002 is at step 2 and train.steps is 1"):
        train(_config("train.steps=1"), CATALOG.plugins, run, progress=False)
    assert (run / "config.toml").read_bytes() == before


def test_a_data_set_regenerated_in_place_is_refused(tmp_path):
    from gem_data.synth import synthesize
    from gem_data.synth_options import SynthOptions

    options = SynthOptions(num_items=300, num_users=100, num_clusters=8, num_advertisers=20,
                           mean_length=8.0, max_length=24)
    data, run = tmp_path / "data", tmp_path / "run"
    synthesize(data, rows=128, seed=1, eval_rows=128, options=options, row_group_rows=64)
    parquet = ["data.source=parquet", f"data.path='{data}'", "data.options.prefetch=0"]
    train(_config("train.steps=1", *parquet), CATALOG.plugins, run, progress=False)
    shutil.rmtree(data)
    synthesize(data, rows=128, seed=2, eval_rows=128, options=options, row_group_rows=64)
    with pytest.raises(GemConfigError, match=r"content_manifest_sha256: '[0-9a-f]+' -> "):
        train(_config("train.steps=2", *parquet), CATALOG.plugins, run, progress=False)


def test_a_full_disk_during_a_checkpoint_is_named(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import filesystem

    def full_disk(transforms, stream, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), stream.name)

    monkeypatch.setattr(filesystem, "_write_item", full_disk)
    with pytest.raises(GemRunError) as failed:
        train(_config("train.steps=1"), CATALOG.plugins, tmp_path, progress=False)
    message = str(failed.value)
    assert message.startswith("cannot write the checkpoint of step 1: no space left on the "
                              "device (ENOSPC) at ")
    assert str(tmp_path / "checkpoints" / ".tmp-step-00000001" / "engine") in message
