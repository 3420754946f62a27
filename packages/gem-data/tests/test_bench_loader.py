"""``gem bench loader``: ours and the TorchRec KJT path on the same files, one JSON object."""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner

from gem_data.bench import bench_loader, bench_schema, make_requests


def test_bench_loader_json(small_dataset):
    pytest.importorskip("torchrec")
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    threads = torch.get_num_threads()
    result = CliRunner().invoke(bench_loader, ["--path", str(small_dataset), "--json",
                                               "--batch-size", "256"])
    # The bench pins itself to one core while measuring and puts everything back.
    assert torch.get_num_threads() == threads
    assert affinity is None or os.sched_getaffinity(0) == affinity
    assert result.exit_code == 0, result.output
    data = json.loads(result.output.strip().splitlines()[-1])
    for name in ("ours_sequential", "ours_shuffled", "ours_sequential_prefetch_thread",
                 "ours_sequential_to_kjt", "torchrec"):
        assert data[name]["samples"] == 3000 and data[name]["tokens_per_s"] > 0, name
    assert data["ours_sequential"]["tokens"] == data["torchrec"]["tokens"]
    assert data["ours_shuffled"]["tokens"] == data["torchrec"]["tokens"]
    assert {"goal_tokens_per_s", "meets_goal", "ours_vs_torchrec"} <= set(data)


def test_generated_requests_are_valid_and_repeatable():
    schema = bench_schema(max_seq_len=128, seq_dense_dim=2)
    a = make_requests(schema, 300, seed=1, index=2)
    b = make_requests(schema, 300, seed=1, index=2)
    a.validate(schema)
    assert torch.equal(a.event_ids["ad"], b.event_ids["ad"])
    assert int(a.seq_lengths().max()) <= 128
    rows = torch.repeat_interleave(torch.arange(300), a.seq_lengths())
    assert bool((a.seq_timestamps < a.request_timestamps[rows]).all())
    assert bool((a.event_ids["ad"] < 0).any())  # 64-bit keys with the top bit set
    assert 1 <= int(a.candidate_counts().min()) and int(a.candidate_counts().max()) <= 4
