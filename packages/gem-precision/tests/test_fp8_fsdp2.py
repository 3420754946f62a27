"""FP8 + FSDP2 on 2 CPU ranks (gloo), through the real launcher: the run trains and evaluates."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gem_core.plugins import build_plugins

GEM = Path(sys.executable).with_name("gem")


# gem-parallel is another package: without it this is not gem-precision's failure to report
@pytest.mark.skipif("fsdp2" not in build_plugins().registry("dense_sharding"),
                    reason="gem-parallel's fsdp2 strategy is not installed")
def test_fp8_tensorwise_with_fp8_all_gather_and_stash_trains_on_two_ranks(tmp_path):
    sets = ["train.steps=2", "train.batch_size=16", "train.warmup_steps=1", "data.max_seq_len=16",
            "data.options.num_items=200", "data.eval_rows=64", "train.eval_batch_size=64",
            "train.eval_every=2", "train.checkpoint_every=2",
            "precision.options.fsdp_float8_all_gather=true",
            "precision.options.activation_fp8=true"]
    command = [str(GEM), "train", "--precision", "fp8-tensorwise", "--sharding", "fsdp2",
               "--nproc-per-node", "2", "--out", str(tmp_path / "run"), "--fresh", "--no-progress"]
    for s in sets:
        command += ["--set", s]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        stdout, stderr = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        # SIGTERM first: torchrun's agent stops its ranks, which run in sessions of their own
        # (killing the launcher alone would leave them hanging).
        os.killpg(process.pid, signal.SIGTERM)
        try:
            stdout, stderr = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
    done = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "12 linear layers in float8" in done.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert all(summary["eval"][task]["ne"] > 0 for task in ("click", "conversion"))
