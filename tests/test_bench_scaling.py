"""``gem bench scaling`` runs real 1- and 2-rank trainings and reports the scaling ratio."""

import json

import pytest


@pytest.mark.distributed
def test_scaling_ratio_from_real_runs(gem):
    done = gem("bench", "scaling", "--ranks", "1", "--ranks", "2", "--steps", "5",
               "--per-rank-batch", "16", "--set", "data.max_seq_len=16", "--json", timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    runs = {run["ranks"]: run for run in report["runs"]}
    assert set(runs) == {1, 2}
    assert runs[1]["scaling_ratio"] == 1.0
    assert runs[2]["global_batch"] == 32
    ratio = runs[2]["samples_per_s"] / (2 * runs[1]["samples_per_s"])
    assert runs[2]["scaling_ratio"] == pytest.approx(ratio)
    assert runs[2]["e2e_mfu"] == pytest.approx(runs[2]["local_mfu"] * ratio)
    assert 0 < ratio < 3  # a sanity bound on a shared 2-core machine, not a speed goal


def test_nnodes_adds_the_largest_node_size_on_several_nodes():
    from gem_parallel.bench_scaling import layouts

    assert layouts((2,), 2) == [(1, 1), (1, 2), (2, 4)]  # 1x1, 1x2, 2x2
    assert layouts((1, 2, 4), 1) == [(1, 1), (1, 2), (1, 4)]
