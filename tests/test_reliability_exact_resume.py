"""Exact resume: in deterministic mode on CPU, 40 steps in one go and 20 + 20 with a stop and a
resume in between give bit-identical losses at every step and identical final weights and
optimizer state (compared with ``==``), in one process and with 2 ranks under FSDP2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from gem_core.checkpoint.checkpointer import read_checkpoint

TINY = ["--set", "train.steps=40", "--set", "train.batch_size=16", "--set", "data.eval_rows=256",
        "--set", "train.eval_batch_size=256", "--set", "train.warmup_steps=2",
        "--set", "train.eval_every=0", "--set", "train.checkpoint_every=10",
        "--set", "data.max_seq_len=16", "--set", "model.interaction_dims=[16]",
        "--set", "train.deterministic=true", "--no-progress"]


def _losses(run_dir: Path) -> list[tuple[int, float, float]]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in
            map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


def assert_identical(a: Any, b: Any, where: str = "") -> None:
    """Nested dicts/lists of tensors and plain values, equal exactly (``torch.equal``, ``==``)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_identical(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    elif torch.is_tensor(a):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    else:
        assert a == b, where


def _whole_and_parts(gem, tmp_path: Path, launch: list[str]) -> tuple[Path, Path]:
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    result = gem("train", "--out", str(whole), *launch, *TINY)
    assert result.returncode == 0, result.stderr[-3000:]
    first = gem("train", "--out", str(parts), "--until-step", "20", *launch, *TINY)
    assert first.returncode == 0, first.stderr[-3000:]
    second = gem("train", "--out", str(parts), *launch, *TINY)
    assert second.returncode == 0, second.stderr[-3000:]
    summary = json.loads((parts / "summary.json").read_text())
    assert summary["run"]["resumed_from"] == 20 and summary["run"]["finished"]
    return whole, parts


def _check_identical(whole: Path, parts: Path) -> None:
    expected = _losses(whole)
    assert [s for s, _, _ in expected] == list(range(1, 41))
    assert _losses(parts) == expected  # every step, bit for bit
    final_whole = read_checkpoint(whole / "checkpoints" / "step-00000040")
    final_parts = read_checkpoint(parts / "checkpoints" / "step-00000040")
    assert final_whole["engine"]["optimizer"]["state"], "no optimizer state was saved"
    assert_identical(final_parts["engine"], final_whole["engine"], "engine")
    for key in ("data", "rng", "totals", "guard", "step"):
        assert_identical(final_parts["trainer"][key], final_whole["trainer"][key], key)


@pytest.mark.distributed
def test_fsdp2_two_ranks_resume_is_bit_identical(gem, tmp_path):
    whole, parts = _whole_and_parts(gem, tmp_path,
                                    ["--nproc-per-node", "2", "--sharding", "fsdp2"])
    summary = json.loads((parts / "summary.json").read_text())
    assert summary["backends"]["dense_sharding"]["name"] == "fsdp2"
    assert summary["checkpoints"]["format"] == "dcp"
    # Each rank wrote its own shard file: nothing was gathered to one rank.
    shards = sorted(p.name for p in (parts / "checkpoints" / "step-00000040" / "engine").iterdir()
                    if p.suffix == ".distcp")
    assert len(shards) == 2, shards
    _check_identical(whole, parts)


@pytest.mark.parametrize("launch", [
    pytest.param([], id="1-process"),
    pytest.param(["--nproc-per-node", "2", "--sharding", "fsdp2"], id="2-ranks-fsdp2",
                 marks=pytest.mark.distributed),
])
def test_async_checkpoints_resume_bit_identical_to_sync(gem, tmp_path, launch):
    """Background saves hold the same state as synchronous ones: a run that stops and resumes
    from asynchronously written checkpoints matches an uninterrupted synchronous run, every
    state bit for bit. (The one-process resume from a synchronous save is
    tests/test_train_e2e.py::test_stopping_and_resuming_gives_the_same_losses_bit_for_bit.)"""
    sync = tmp_path / "sync"
    result = gem("train", "--out", str(sync), *launch, *TINY)
    assert result.returncode == 0, result.stderr[-3000:]
    parts = tmp_path / "async"
    for extra in (["--until-step", "20"], []):
        result = gem("train", "--out", str(parts), *launch, *extra, *TINY,
                     "--set", "train.async_checkpoint=true")
        assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((parts / "summary.json").read_text())
    assert summary["checkpoints"]["async"] is True and summary["run"]["resumed_from"] == 20
    assert not list((parts / "checkpoints").glob(".tmp-*")), "a save was left unpublished"
    _check_identical(sync, parts)


@pytest.mark.distributed
def test_deepspeed_zero1_two_ranks_resume_is_bit_identical(gem, tmp_path):
    """DeepSpeed keeps the full-state checkpoint path; its resume must still restore the
    weights the first resumed step runs on (stages 1-2 once ran that step on the initial
    weights: the loss after the resume point differed by 0.14)."""
    short = [*TINY, "--set", "train.steps=6", "--set", "train.checkpoint_every=3"]
    launch = ["--nproc-per-node", "2", "--sharding", "deepspeed-zero1"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    for out, extra in ((whole, []), (parts, ["--until-step", "3"]), (parts, [])):
        result = gem("train", "--out", str(out), *launch, *extra, *short)
        assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((parts / "summary.json").read_text())["run"]["resumed_from"] == 3
    assert _losses(parts) == _losses(whole)  # every step, bit for bit
    final = [read_checkpoint(run / "checkpoints" / "step-00000006")["engine"]["model"]
             for run in (whole, parts)]
    assert_identical(final[1], final[0], "model")
