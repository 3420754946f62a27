"""The run directory's guards, without training: the lock, the start-up write probe, disk-full
messages, torn log lines, settings out of range, bounded rollbacks and the data fingerprint."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from gem_core.config import TrainConfig, load_config
from gem_core.distributed import resolve_device
from gem_core.errors import GemConfigError, GemRunError
from gem_core.train import run_dir as run_dir_module
from gem_core.train.data_fingerprint import check_same_data, data_fingerprint
from gem_core.train.environment import probe_run_directory
from gem_core.train.guard import StepGuard
from gem_core.train.run_dir import RunDirectory
from gem_core.train.run_lock import LOCK_NAME, RunLock


def test_a_second_lock_is_refused_naming_the_holder(tmp_path):
    first = RunLock.acquire(tmp_path / "run")
    try:
        with pytest.raises(GemRunError, match=rf"in use by another trainer \(pid {os.getpid()} "
                                              r"on host .+, started 20\d\d-"):
            RunLock.acquire(tmp_path / "run")
    finally:
        first.release()
    RunLock.acquire(tmp_path / "run").release()  # free again once released


def test_a_stale_lock_is_taken_over_and_its_holder_rewritten(tmp_path):
    # What a killed trainer leaves: the file with its details, no lock (the kernel dropped it).
    (tmp_path / LOCK_NAME).write_text(json.dumps(
        {"pid": 999999999, "host": "gone", "started": "2026-01-01T00:00:00+00:00",
         "command": "gem train"}) + "\n")
    lock = RunLock.acquire(tmp_path)
    try:
        holder = json.loads((tmp_path / LOCK_NAME).read_text())
        assert holder["pid"] == os.getpid() and holder["host"] != "gone"
    finally:
        lock.release()


def test_an_unusable_out_is_named(tmp_path):
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(GemRunError, match="a-file/run as the run directory .* is a file"):
        RunLock.acquire(tmp_path / "a-file" / "run")


def _probe_as_unprivileged_user(run: Path) -> str:
    """``probe_run_directory(run)``'s error message, run as a user that file modes apply to
    (root ignores them: a forked child drops to ``nobody``)."""
    if os.geteuid() != 0:
        try:
            probe_run_directory(run)
        except GemRunError as error:
            return str(error)
        return ""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child process
        message = ""
        try:
            os.setgid(65534)
            os.setuid(65534)
            probe_run_directory(run)
        except GemRunError as error:
            message = str(error)
        finally:
            os.write(write, message.encode())
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        message = pipe.read()
    os.waitpid(child, 0)
    return message


def test_read_only_checkpoints_are_found_before_training():
    parent = Path(tempfile.mkdtemp())
    try:
        parent.chmod(0o755)
        run = parent / "run"
        (run / "checkpoints").mkdir(parents=True)
        run.chmod(0o777)
        (run / "checkpoints").chmod(0o555)
        message = _probe_as_unprivileged_user(run)
        assert "cannot write checkpoints: permission denied (EACCES)" in message
        assert str(run / "checkpoints") in message
        (run / "checkpoints").chmod(0o777)
        assert _probe_as_unprivileged_user(run) == ""
    finally:
        for path in sorted(parent.rglob("*"), reverse=True):
            path.chmod(0o755)
        shutil.rmtree(parent)


def test_a_full_disk_during_a_log_write_is_named(tmp_path, monkeypatch):
    def full_disk(handle, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(run_dir_module, "_write_line", full_disk)
    run = RunDirectory(tmp_path, enabled=True)
    with pytest.raises(GemRunError, match=r"cannot write metrics.jsonl: no space left on the "
                                          r"device \(ENOSPC\) at .*metrics.jsonl; free space"):
        run.append_metrics({"step": 1, "loss": 0.5})


def test_a_torn_last_line_is_dropped_with_a_warning_and_an_inner_one_named(tmp_path, caplog):
    run = RunDirectory(tmp_path, enabled=True)
    for step in (1, 2, 3):
        run.append_metrics({"step": step, "loss": 1.0 / step})
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 4, "lo')  # the process died mid-write
    with caplog.at_level(logging.WARNING):
        run.truncate_metrics(after_step=2)
    assert "torn by an interrupted write" in caplog.text
    assert [json.loads(line)["step"] for line in
            (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "metrics.jsonl").write_text(lines[0] + '\n{"step": 2,\n' + lines[1] + "\n")
    with pytest.raises(GemRunError, match=r"metrics.jsonl line 2 is not a JSON record"):
        run.truncate_metrics(after_step=2)


@pytest.mark.parametrize("override, message", [
    ("train.lr=inf", "train.lr must be a finite number; got inf"),
    ("train.lr=1e400", "train.lr must be a finite number; got inf"),
    ("train.grad_clip=nan", "train.grad_clip must be a finite number; got nan"),
    ("model.moe.capacity_factor=-inf", "model.moe.capacity_factor must be a finite number"),
    ("train.seed=4294967296", "train.seed must be between 0 and 4294967295"),
    ("train.seed=-1", "train.seed must be between 0 and 4294967295"),
])
def test_settings_out_of_range_are_refused_at_start_up(override, message):
    with pytest.raises(GemConfigError, match=message.replace("(", r"\(")):
        load_config(overrides=[override])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(GemConfigError, match="train.device = 'cuda' but there is no CUDA device"):
        resolve_device("cuda")


def _bad_steps(guard: StepGuard, count: int) -> None:
    for _ in range(count):
        guard.record(float("nan"), guard.verdict(float("nan"), 1.0))


def test_rollbacks_stop_after_max_rollbacks_without_progress():
    guard = StepGuard(TrainConfig(max_bad_steps=2, max_rollbacks=2))
    for _ in range(2):  # fails at steps 3-4 after every rollback to step 2
        guard.record(1.0, None)
        _bad_steps(guard, 2)
        guard.after_rollback(guard.before_rollback(2, last_step=4))
    guard.record(1.0, None)
    _bad_steps(guard, 2)
    with pytest.raises(GemRunError) as stopped:
        guard.before_rollback(2, last_step=4)
    message = str(stopped.value)
    assert "train.max_rollbacks = 2" in message
    assert ("1. steps 3-4: non-finite loss x2, rolled back to step 2; 2. steps 3-4: non-finite "
            "loss x2, rolled back to step 2; 3. steps 3-4: non-finite loss x2.") in message
    assert guard.rollbacks == 2


def test_getting_past_the_failing_steps_is_progress():
    guard = StepGuard(TrainConfig(max_bad_steps=2, max_rollbacks=1))
    _bad_steps(guard, 2)
    guard.after_rollback(guard.before_rollback(2, last_step=4))
    _bad_steps(guard, 2)  # a new fault later on: steps 9-10, after the run got past step 4
    guard.after_rollback(guard.before_rollback(8, last_step=10))
    assert guard.rollbacks == 2
    _bad_steps(guard, 2)
    with pytest.raises(GemRunError, match="no checkpoint to roll back to"):
        guard.before_rollback(None, last_step=2)


def test_the_data_fingerprint_refuses_another_seed_or_data_set(tmp_path, caplog):
    base = load_config(overrides=["train.seed=1"])
    saved = data_fingerprint(base, {})
    reseeded = data_fingerprint(load_config(overrides=["train.seed=2"]), {})
    with pytest.raises(GemConfigError, match=r"seed: 1 -> 2.*--allow-data-change"):
        check_same_data(saved, reseeded, tmp_path, allow_change=False)
    with caplog.at_level(logging.WARNING):
        check_same_data(saved, reseeded, tmp_path, allow_change=True)
    assert "seed: 1 -> 2" in caplog.text
    check_same_data(saved, data_fingerprint(base, {}), tmp_path, allow_change=False)
    # A data set: its manifest digest decides; the same data set at another path is the same.
    here = data_fingerprint(load_config(overrides=["data.path='a'"]), {"manifest": "1"})
    moved = data_fingerprint(load_config(overrides=["data.path='b'"]), {"manifest": "1"})
    check_same_data(here, moved, tmp_path, allow_change=False)
    rewritten = data_fingerprint(load_config(overrides=["data.path='a'"]), {"manifest": "2"})
    with pytest.raises(GemConfigError, match="content_manifest: '1' -> '2'"):
        check_same_data(here, rewritten, tmp_path, allow_change=False)
