"""Managed ids resume exactly: the remapper's state (id -> row map, LRU counters, iteration) is in
the checkpoint (DCP), and a run stopped after step 2 and resumed gives the uninterrupted run's
loss at every step bit for bit, and the same remapper state at the end. One process on the
TorchRec path (``--embedding-sharding torchrec``, a process group of one rank), synthetic ads
whose ``ad`` table (64 rows) is far smaller than the ads a batch shows, so every step evicts."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from gem_core.checkpoint.checkpointer import read_checkpoint

RUN = ["--data", "synthetic-ads", "--embedding-sharding", "torchrec",
       "--set", "backends.embedding=torchrec-managed",
       "--set", "data.options.ad_id_policy=managed", "--set", "data.options.ad_table_size=64",
       "--set", "data.options.num_items=500", "--set", "data.options.num_users=200",
       "--set", "train.steps=4", "--set", "train.batch_size=8", "--set", "data.eval_rows=32",
       "--set", "train.eval_batch_size=32", "--set", "train.warmup_steps=1",
       "--set", "train.eval_every=0", "--set", "train.checkpoint_every=2",
       "--set", "data.max_seq_len=16", "--set", "model.interaction_dims=[16]",
       "--set", "train.deterministic=true", "--no-progress"]
REMAPPER = "embeddings.remappers.ad.mch."


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in
            map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


def test_managed_ids_resume_bit_identical(gem, tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    for out, extra in ((whole, []), (parts, ["--until-step", "2"]), (parts, [])):
        result = gem("train", "--out", str(out), *extra, *RUN)
        assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((parts / "summary.json").read_text())["run"]["resumed_from"] == 2
    assert [s for s, _ in _losses(whole)] == [1, 2, 3, 4]
    assert _losses(parts) == _losses(whole)
    states = [{k[len(REMAPPER):]: v for k, v in
               read_checkpoint(run / "checkpoints" / "step-00000004")["engine"]["model"].items()
               if k.startswith(REMAPPER)} for run in (whole, parts)]
    assert states[0].keys() == states[1].keys() and len(states[0]) == 5
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert int(states[0]["_current_iter_tensor"]) == 4  # one remapper iteration per step
    live = states[0]["_mch_sorted_raw_ids"] != 2**63 - 1
    assert int(live.sum()) == 63  # full: 63 live ids and the shared row
    halfway = read_checkpoint(whole / "checkpoints" / "step-00000002")["engine"]["model"]
    # Steps 3 and 4 evicted ids that steps 1 and 2 had inserted.
    assert set(halfway[REMAPPER + "_mch_sorted_raw_ids"].tolist()) != \
        set(states[0]["_mch_sorted_raw_ids"].tolist())
