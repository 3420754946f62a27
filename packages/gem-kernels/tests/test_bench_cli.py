"""``gem bench attention --json`` on tiny sizes: one JSON object naming what it measured."""

import json

from click.testing import CliRunner

from gem_core.attention.api import AttentionParams
from gem_core.attention.masks import count_visible_keys
from gem_kernels.bench.cli import bench_attention
from gem_kernels.bench.flops import causal_window_pairs
from gem_kernels.bench.lengths import sample_lengths


def test_json_output_on_tiny_sizes():
    result = CliRunner().invoke(bench_attention, [
        "--json", "--device", "cpu", "--batch-size", "4", "--max-len", "24", "--heads", "1",
        "--head-dim", "16", "--repeats", "1", "--warmup", "0", "--window", "4",
        "--backend", "reference", "--backend", "fbgemm",
    ])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["backends"] == ["fbgemm", "reference"]
    assert set(report["shapes"]) == {"self", "cross", "pma"}
    for shape in report["shapes"].values():
        assert shape["fwd_bwd_flops_padded"] >= shape["fwd_bwd_flops_jagged"] > 0
        assert shape["padded_over_jagged_flops"] >= 1
        assert {"sdpa_padded_masked", "reference", "fbgemm"} <= set(shape["fwd_bwd_median_s"])
        assert set(shape["speedup_over_fastest_padded_sdpa"]) == {"reference", "fbgemm"}
        assert shape["best_backend"] in {"reference", "fbgemm"}


def test_naming_a_backend_that_cannot_run_here_fails():
    result = CliRunner().invoke(bench_attention, [
        "--json", "--device", "cpu", "--max-len", "8", "--repeats", "1", "--backend", "triton",
    ])
    assert result.exit_code != 0
    assert "triton" in str(result.exception) and "cpu" in str(result.exception)


def test_counted_pairs_match_the_mask():
    for length in (1, 5, 17):
        for window in (None, 0, 3, 40):
            params = AttentionParams(causal=True, window=window)
            assert causal_window_pairs(length, window) == count_visible_keys(length, 0, params)


def test_zipf_lengths_are_capped_and_heavy_tailed():
    lengths = sample_lengths(2000, 512, seed=1)
    assert min(lengths) >= 1 and max(lengths) == 512
    assert sorted(lengths)[1000] < 64  # the median history is far below the cap
