"""FP8 + FSDP2 on 2 CPU ranks (gloo), through the real launcher: the run trains and evaluates."""

import json
import os
import sys
from pathlib import Path

import pytest

from gem_core.plugins import build_plugins
from gem_core.testing.processes import run_process_group

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
    # The timeout is for a hang: a loaded CI machine takes minutes to start the ranks.
    done = run_process_group(command, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "16 linear layers in float8" in done.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert all(summary["eval"][task]["ne"] > 0 for task in ("click", "conversion"))
