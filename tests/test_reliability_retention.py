"""Retention: the last ``train.keep_checkpoints`` checkpoints plus the best by evaluation NE (mean
over tasks), which the keep-last rotation never deletes; summary.json names it."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from gem_core.checkpoint.layout import (
    COMPLETE,
    complete_checkpoints,
    prepare_staging,
    publish,
    write_info,
)
from gem_core.checkpoint.retention import best_checkpoint, retain

RUN = ["--set", "train.steps=10", "--set", "train.batch_size=16", "--set", "data.eval_rows=256",
       "--set", "train.eval_batch_size=256", "--set", "train.warmup_steps=1",
       "--set", "train.eval_every=2", "--set", "train.checkpoint_every=2",
       "--set", "train.keep_checkpoints=1", "--set", "data.max_seq_len=16",
       "--set", "model.interaction_dims=[16]", "--no-progress"]
# Resumed after step 4 with a learning rate 1000 times too high, the evaluation NE blows up (to
# 48-160 against 1.47 at step 4, measured), so the best checkpoint is an early one that the
# keep-last rotation would otherwise delete. (0.3 was too mild: the NE recovered by step 10.)
TOO_HIGH_LR = ["--set", "train.lr=1.0"]


def _steps(run_dir: Path) -> list[int]:
    return [step for step, _ in complete_checkpoints(run_dir)]


def test_rotation_keeps_the_best_checkpoint(tmp_path):
    for step, ne in ((2, 0.9), (4, 0.7), (6, None), (8, 0.8), (10, 0.95)):
        staging = prepare_staging(tmp_path, step)
        write_info(staging, step=step, format="dcp", ne=ne)
        publish(tmp_path, step)
        retain(tmp_path, keep_last=2, keep_best=True)
    assert _steps(tmp_path) == [4, 8, 10]
    assert best_checkpoint(tmp_path) == (4, 0.7)
    assert all((path / COMPLETE).exists() for _, path in complete_checkpoints(tmp_path))
    assert retain(tmp_path, keep_last=1, keep_best=False) == [10]
    assert _steps(tmp_path) == [10]


def test_run_keeps_last_and_best_and_reports_the_best(gem, tmp_path):
    first = gem("train", "--out", str(tmp_path), "--until-step", "4", *RUN)
    assert first.returncode == 0, first.stderr[-3000:]
    result = gem("train", "--out", str(tmp_path), *RUN, *TOO_HIGH_LR)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    ne = {e["step"]: statistics.fmean(e[t]["ne"] for t in ("click", "conversion"))
          for e in summary["eval_history"]}
    best_step = min(ne, key=ne.get)
    assert best_step in (2, 4), f"the too-high learning rate did not worsen NE: {ne}"
    assert summary["checkpoints"]["best"] == {"step": best_step, "ne": ne[best_step]}
    assert summary["checkpoints"]["best_by"] == "mean evaluation NE over tasks"
    assert _steps(tmp_path) == sorted({best_step, 10})
    assert summary["checkpoints"]["kept_steps"] == sorted({best_step, 10})

    # Without keep_best the rotation alone decides: only the last survives.
    plain = tmp_path / "plain"
    again = gem("train", "--out", str(plain), *RUN, *TOO_HIGH_LR, "--set", "train.keep_best=false")
    assert again.returncode == 0, again.stderr[-3000:]
    assert _steps(plain) == [10]
    assert json.loads((plain / "summary.json").read_text())["checkpoints"]["best"] is None
