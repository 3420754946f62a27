"""A process SIGKILLed in the middle of writing a checkpoint (synchronous or background save):
the torn checkpoint is never loaded, the previous one loads, and the resumed run equals an
uninterrupted one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gem_core.checkpoint.checkpointer import read_checkpoint
from gem_core.checkpoint.layout import latest_checkpoint

RUN = ["--set", "train.steps=6", "--set", "train.batch_size=16", "--set", "data.eval_rows=256",
       "--set", "train.eval_batch_size=256", "--set", "train.warmup_steps=1",
       "--set", "train.eval_every=0", "--set", "train.checkpoint_every=2",
       "--set", "data.max_seq_len=16", "--set", "model.interaction_dims=[16]",
       "--set", "train.deterministic=true", "--no-progress"]

# `gem train` in a process whose checkpoint writer SIGKILLs the whole process right after it
# has written the tensor files of step 4 (before DCP's metadata, the marker and the rename).
KILL_DURING_SAVE = """
import os, signal, sys
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from gem_core.cli.main import main

original = FileSystemWriter.write_data

def write_then_die(self, plan, planner):
    written = original(self, plan, planner)
    if "step-00000004" in str(self.path):
        written.wait()
        os.kill(os.getpid(), signal.SIGKILL)
    return written

FileSystemWriter.write_data = write_then_die
sys.argv = ["gem", *sys.argv[1:]]
main()
"""


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in
            map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


@pytest.fixture(scope="module")
def uninterrupted(gem, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("calm") / "run"
    result = gem("train", "--out", str(out), *RUN)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_saver_killed_mid_write_leaves_the_previous_checkpoint(gem, tmp_path, uninterrupted,
                                                               mode):
    out = tmp_path / "run"
    extra = ["--set", f"train.async_checkpoint={'true' if mode == 'async' else 'false'}"]
    killed = subprocess.run([sys.executable, "-c", KILL_DURING_SAVE, "train", "--out", str(out),
                             *RUN, *extra], capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr[-3000:]  # SIGKILL

    # The torn save: tensor files on disk under the temporary name, no metadata, no marker.
    torn = out / "checkpoints" / ".tmp-step-00000004"
    assert any(p.suffix == ".distcp" for p in (torn / "engine").iterdir())
    assert not (torn / "engine" / ".metadata").exists() and not (torn / "COMPLETE").exists()
    assert not (out / "checkpoints" / "step-00000004").exists()
    step, path = latest_checkpoint(out)
    assert step == 2
    assert read_checkpoint(path)["trainer"]["step"] == 2  # the previous checkpoint loads

    resumed = gem("train", "--out", str(out), *RUN, *extra)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "removed" in resumed.stderr and ".tmp-step-00000004" in resumed.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["resumed_from"] == 2 and summary["run"]["finished"]
    assert _losses(out) == _losses(uninterrupted)
    assert not torn.exists()
