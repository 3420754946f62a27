"""TorchRec-sharded embedding tables (with DDP for the dense part) through DCP checkpoints: a stop
and resume on the same 2 ranks continues bit for bit; another number of ranks is refused with an
error naming the checkpoint's ranks (TorchRec's fused-optimizer state is per rank)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

RUN = ["--sharding", "ddp", "--embedding-sharding", "torchrec",
       "--set", "train.steps=4", "--set", "train.batch_size=32", "--set", "data.eval_rows=256",
       "--set", "train.eval_batch_size=256", "--set", "train.warmup_steps=1",
       "--set", "train.eval_every=0", "--set", "train.checkpoint_every=2",
       "--set", "data.max_seq_len=16", "--set", "model.interaction_dims=[16]", "--no-progress"]


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"]
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.distributed
def test_torchrec_tables_resume_exactly_and_refuse_resharding(gem, tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    result = gem("train", "--out", str(whole), "--nproc-per-node", "2", *RUN)
    assert result.returncode == 0, result.stderr[-3000:]
    first = gem("train", "--out", str(parts), "--nproc-per-node", "2", "--until-step", "2", *RUN)
    assert first.returncode == 0, first.stderr[-3000:]
    stopped = tmp_path / "stopped"
    shutil.copytree(parts, stopped)
    second = gem("train", "--out", str(parts), "--nproc-per-node", "2", *RUN)
    assert second.returncode == 0, second.stderr[-3000:]
    assert json.loads((parts / "summary.json").read_text())["run"]["resumed_from"] == 2
    assert _losses(parts) == _losses(whole)

    four = gem("train", "--out", str(stopped), "--nproc-per-node", "4", *RUN)
    assert four.returncode != 0
    assert ("was written by 2 ranks and does not load into 4 (embedding sharding 'torchrec')"
            in four.stderr and "Resume with 2 ranks" in four.stderr), four.stderr[-3000:]
