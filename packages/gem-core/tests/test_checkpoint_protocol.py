"""The on-disk checkpoint protocol without training: digests and their verification, re-saving a
published step (a complete copy at every moment), recovery of interrupted saves, retention of
the newest verified checkpoint, and the trainer state as JSON plus tensors."""

from __future__ import annotations

import math
import os
import random
import shutil

import numpy as np
import pytest
import torch

from gem_core.checkpoint import layout
from gem_core.checkpoint.digests import share_of, verify_files, write_digests
from gem_core.checkpoint.io import read_trainer_state, write_trainer_state
from gem_core.checkpoint.layout import (
    COMPLETE,
    complete_checkpoints,
    prepare_staging,
    publish,
    remove_torn,
    write_info,
)
from gem_core.checkpoint.retention import retain
from gem_core.errors import GemCheckpointError


def _save(run_dir, step: int, content: str) -> None:
    staging = prepare_staging(run_dir, step)
    write_info(staging, step=step, format="dcp", ne=None)
    (staging / "engine").mkdir()
    (staging / "engine" / "shard.bin").write_text(content * 100)


def _content(path) -> str:
    return (path / "engine" / "shard.bin").read_text()[:3]


def _complete_copies(run_dir, step: int) -> list[str]:
    """Contents of the complete copies of ``step`` on disk (published or set aside)."""
    root = run_dir / "checkpoints"
    return [_content(root / name) for name in (f"step-{step:08d}", f".replaced-step-{step:08d}")
            if (root / name / COMPLETE).is_file()]


def test_digests_name_every_kind_of_damage(tmp_path):
    _save(tmp_path, 2, "abc")
    final = publish(tmp_path, 2)
    assert verify_files(final) == []
    info_bytes = (final / "info.json").stat().st_size
    (final / "info.json").write_bytes(b"")
    shard = final / "engine" / "shard.bin"
    data = bytearray(shard.read_bytes())
    data[150] ^= 1
    shard.write_bytes(bytes(data))
    assert verify_files(final) == [
        "engine/shard.bin: content differs from its sha256 digest",
        f"info.json: 0 bytes, written as {info_bytes} (truncated or overwritten)"]
    shard.unlink()
    assert "engine/shard.bin: missing" in verify_files(final)
    (final / "digests.json").write_text('{"algorithm": "sha256", "files": {"../../x": '
                                        '{"bytes": 1, "sha256": "00"}}}')
    assert verify_files(final) == ["digests.json: unreadable ('../../x' is outside the "
                                   "checkpoint)"]


def test_every_file_is_hashed_by_exactly_one_rank(tmp_path):
    for i, size in enumerate([5, 1, 9, 3, 3, 7, 0]):
        (tmp_path / f"f{i}").write_bytes(b"x" * size)
    files = write_digests(tmp_path)["files"]
    shares = [share_of(files, rank, 3) for rank in range(3)]
    assert sorted(sum(shares, [])) == sorted(files)
    assert [sum(files[n]["bytes"] for n in share) for share in shares] == [9, 10, 9]


def test_resaving_a_step_keeps_a_complete_copy_at_every_moment(tmp_path, monkeypatch):
    _save(tmp_path, 4, "old")
    publish(tmp_path, 4)
    _save(tmp_path, 4, "new")
    seen = []

    def checked(operation):
        def run(*args, **kwargs):
            seen.append(_complete_copies(tmp_path, 4))
            assert seen[-1], f"no complete copy of step 4 before {operation.__name__}{args}"
            return operation(*args, **kwargs)
        return run

    monkeypatch.setattr(layout.os, "replace", checked(os.replace))
    monkeypatch.setattr(layout.shutil, "rmtree", checked(shutil.rmtree))
    publish(tmp_path, 4)
    monkeypatch.undo()
    assert seen == [["old"], ["old"], ["new", "old"]]  # aside, new in, old deleted
    assert _complete_copies(tmp_path, 4) == ["new"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000004"]


@pytest.mark.parametrize("killed_at_rename", [1, 2])
def test_a_resave_killed_between_marker_and_rename_is_published_on_the_next_start(
        tmp_path, monkeypatch, killed_at_rename):
    """Killed after the COMPLETE marker: before the old copy was set aside (rename 1) or
    between setting it aside and renaming the new one in (rename 2). The next start publishes
    the finished save and drops the old copy; nothing is deleted as torn."""
    _save(tmp_path, 4, "old")
    publish(tmp_path, 4)
    _save(tmp_path, 4, "new")
    renames = []

    def killed(*args):
        renames.append(args)
        if len(renames) == killed_at_rename:
            raise KeyboardInterrupt("killed")
        return os.replace(*args)

    monkeypatch.setattr(layout.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        publish(tmp_path, 4)
    monkeypatch.undo()
    assert (tmp_path / "checkpoints" / ".tmp-step-00000004" / COMPLETE).is_file()
    assert remove_torn(tmp_path) == []
    assert _complete_copies(tmp_path, 4) == ["new"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000004"]
    assert verify_files(tmp_path / "checkpoints" / "step-00000004") == []


def test_recovery_restores_a_set_aside_copy_and_removes_torn_saves(tmp_path):
    _save(tmp_path, 2, "two")
    publish(tmp_path, 2)
    root = tmp_path / "checkpoints"
    os.replace(root / "step-00000002", root / ".replaced-step-00000002")  # set aside, then
    _save(tmp_path, 2, "new")  # the new copy was still being written (no marker): torn
    assert remove_torn(tmp_path) == [root / ".tmp-step-00000002"]
    assert _complete_copies(tmp_path, 2) == ["two"]
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002"]


def test_retention_keeps_the_protected_step(tmp_path):
    for step in (2, 4, 6):
        _save(tmp_path, step, "abc")
        publish(tmp_path, step)
    assert retain(tmp_path, keep_last=1, keep_best=False, protect=[4]) == [4, 6]
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [4, 6]


def test_trainer_state_round_trips_exactly_without_pickles(tmp_path):
    random.seed(3)
    np.random.seed(3)
    state = {
        "rng": [{"python": random.getstate(), "numpy": np.random.get_state(),
                 "torch": torch.get_rng_state()}],
        "config": {"model": {"interaction_dims": (16, 8)}, "lr": 1e-3},
        "by_int": {1: "a", (2, 3): [np.int64(7), np.float32(0.5), np.float64(0.25), None, True]},
        "__gem__": "a user's key", "eval": {"auc": float("nan"), "ne": float("inf")},
    }
    files = tmp_path / "trainer.json", tmp_path / "trainer-tensors.pt"
    write_trainer_state(state, *files)
    back = read_trainer_state(*files)
    assert back["config"] == state["config"] and back["__gem__"] == "a user's key"
    assert back["by_int"] == state["by_int"]
    assert [type(v) for v in back["by_int"][(2, 3)][:3]] == [np.int64, np.float32, np.float64]
    assert math.isnan(back["eval"]["auc"]) and back["eval"]["ne"] == math.inf
    random.setstate(back["rng"][0]["python"])
    np.random.set_state(back["rng"][0]["numpy"])
    torch.set_rng_state(back["rng"][0]["torch"])
    assert (random.random(), np.random.rand()) == (
        (random.seed(3), random.random())[1], (np.random.seed(3), np.random.rand())[1])
    assert back["rng"][0]["numpy"][1].dtype == np.uint32
    with pytest.raises(TypeError, match=r"state.config.bad is a set"):
        write_trainer_state({"config": {"bad": {1}}}, *files)
    files[1].write_bytes(b"not a tensor file")
    with pytest.raises(GemCheckpointError, match="trainer-tensors.pt is not a readable tensor"):
        read_trainer_state(*files)
