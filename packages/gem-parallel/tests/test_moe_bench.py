"""``gem bench moe --json``: both MoE paths timed on the same layer, and the all-to-all bytes of
a 2-rank ``ep`` step measured against their predictions."""

from __future__ import annotations

import json
import os
import sys

import pytest

from gem_core.testing.processes import run_process_group
from gem_parallel.bench_moe import LAYER, predicted_bytes_uniform


def test_uniform_prediction_formula():
    # 100 tokens x top-2, half of them off-rank on 2 ranks, 64 floats, sent 4 times.
    assert predicted_bytes_uniform(100, top_k=2, dim=64, ep_size=2) == 4 * 100 * 2 * 0.5 * 64 * 4
    assert predicted_bytes_uniform(100, top_k=2, dim=64, ep_size=1) == 0


@pytest.mark.distributed
def test_bench_moe_json_reports_paths_and_traffic():
    # The cost is starting processes (this one and its 2 ranks), not the layer: the smallest
    # token counts and one repeat check the report as well as many. The timeout is for a hang
    # only: a loaded CI machine takes minutes to start them.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = run_process_group(
        [sys.executable, "-m", "gem_core.cli.main", "bench", "moe", "--json", "--tokens",
         "32,64", "--repeats", "1", "--traffic-tokens", "256"], env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["layer"]["experts"] == 8 == LAYER["experts"]
    assert report["repeats"] == 1
    assert [p["tokens"] for p in report["paths"]] == [32, 64]
    for entry in report["paths"]:
        assert entry["reference_tokens_per_s"] > 0 and entry["grouped_tokens_per_s"] > 0
        assert entry["grouped_speedup"] == pytest.approx(
            entry["grouped_tokens_per_s"] / entry["reference_tokens_per_s"])
        assert entry["grouped_backend"] in ("grouped_mm", "padded_bmm")
        assert entry["max_abs_output_difference"] < 1e-5  # the same function
    traffic = report["all_to_all"]
    uniform = traffic["predicted_bytes_per_rank_uniform_routing"]
    for rank in traffic["per_rank"]:
        assert rank["all_to_all_calls"] == 4  # dispatch + combine, forward + backward
        # Exactly the rows routed off-rank and back, twice (forward and backward).
        assert rank["measured_bytes"] == rank["predicted_bytes_from_routed_counts"]
        assert rank["measured_bytes"] == pytest.approx(uniform, rel=0.3)
        assert rank["measured_bytes_including_self"] > rank["measured_bytes"]
