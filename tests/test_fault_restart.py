"""A rank killed mid-run: torchrun restarts the group, the run resumes from its latest complete
checkpoint by itself, and the losses equal those of an uninterrupted run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUN = ["--nproc-per-node", "2", "--set", "train.steps=8", "--set", "train.batch_size=32",
       "--set", "data.eval_rows=128", "--set", "train.eval_batch_size=128",
       "--set", "train.eval_every=0", "--set", "train.checkpoint_every=2",
       "--set", "train.warmup_steps=1", "--set", "data.max_seq_len=32",
       "--set", "backends.embedding=rank-killer", "--no-progress"]


@pytest.fixture(scope="module")
def fault_env(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--target", str(target),
                    str(REPO / "tests" / "fixtures" / "gem-fault-plugin")],
                   check=True, capture_output=True, timeout=300)
    path = os.pathsep.join(p for p in [str(target), os.environ.get("PYTHONPATH", "")] if p)
    return {"PYTHONPATH": path}


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in
            map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.distributed
def test_killed_rank_is_restarted_and_the_run_resumes_exactly(gem, fault_env, tmp_path):
    calm = {**fault_env, "GEM_FAULT_STEP": "1000", "GEM_FAULT_MARKER": str(tmp_path / "m0")}
    assert gem("train", "--out", str(tmp_path / "calm"), *RUN, env=calm).returncode == 0

    marker = tmp_path / "fired"
    faulty = {**fault_env, "GEM_FAULT_STEP": "5", "GEM_FAULT_RANK": "1",
              "GEM_FAULT_MARKER": str(marker)}
    result = gem("train", "--out", str(tmp_path / "faulty"), "--max-restarts", "1", *RUN,
                 env=faulty)
    assert result.returncode == 0, result.stderr[-4000:]
    assert marker.exists(), "the fault never fired"
    summary = json.loads((tmp_path / "faulty" / "summary.json").read_text())
    assert summary["run"]["resumed_from"] == 4 and summary["run"]["finished"]
    assert _losses(tmp_path / "faulty") == _losses(tmp_path / "calm")


@pytest.mark.distributed
def test_without_restarts_a_killed_rank_fails_the_run(gem, fault_env, tmp_path):
    env = {**fault_env, "GEM_FAULT_STEP": "3", "GEM_FAULT_MARKER": str(tmp_path / "fired")}
    result = gem("train", "--out", str(tmp_path / "run"), *RUN, env=env)
    assert result.returncode != 0
    assert "torchrun with 2 ranks exited with status" in result.stderr
