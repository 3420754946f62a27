"""The synthetic ads generator's drift option and time windows: the planted process moves with
the chunk's time, still a pure function of (seed, split, index)."""

from __future__ import annotations

import attrs
import numpy as np
import torch

from gem_data.generator import AdsLogGenerator, achievable_ne
from gem_data.synth_options import SynthOptions

SMALL = SynthOptions(num_items=300, num_users=300, max_candidates=4, max_length=24,
                     drift_weight=1.0, drift_period=100.0)


def _logit(p: np.ndarray) -> np.ndarray:
    return np.log(p) - np.log1p(-p)


def test_train_start_shifts_the_window():
    early = AdsLogGenerator(SMALL, seed=3)
    late = AdsLogGenerator(attrs.evolve(SMALL, train_start=5), seed=3)
    a, pa = early.chunk_with_probabilities(16, split="train", index=7)
    b, pb = late.chunk_with_probabilities(16, split="train", index=2)
    assert torch.equal(a.labels["click"], b.labels["click"])
    assert torch.equal(a.candidate_ids["ad_id"], b.candidate_ids["ad_id"])
    np.testing.assert_array_equal(pa["click"], pb["click"])
    c, _ = late.chunk_with_probabilities(16, split="train", index=7)  # another window
    assert not torch.equal(a.candidate_ids["ad_id"], c.candidate_ids["ad_id"])


def test_the_click_logit_moves_by_the_category_drift():
    times = (0, 30)
    chunks = [AdsLogGenerator(attrs.evolve(SMALL, eval_time=t), seed=1)
              .chunk_with_probabilities(64, split="eval", index=0) for t in times]
    (batch, p0), (_, p1) = chunks
    generator = AdsLogGenerator(SMALL, seed=1)
    category = batch.candidate_ids["category"].numpy()
    expected = generator.category_drift(30)[category] - generator.category_drift(0)[category]
    assert np.abs(expected).max() > 0.3
    np.testing.assert_allclose(_logit(p1["click"]) - _logit(p0["click"]), expected, atol=1e-9)
    # The requests are the same; only the label process moved.
    assert torch.equal(batch.candidate_ids["ad_id"], chunks[1][0].candidate_ids["ad_id"])
    still = attrs.evolve(SMALL, drift_weight=0.0)
    steady = [AdsLogGenerator(attrs.evolve(still, eval_time=t), seed=1)
              .chunk_with_probabilities(64, split="eval", index=0)[1]["click"] for t in times]
    np.testing.assert_array_equal(*steady)


def test_achievable_ne_is_that_of_the_present():
    now = {t: achievable_ne(AdsLogGenerator(attrs.evolve(SMALL, eval_time=t), seed=2), 256)
           for t in (0, 50)}
    assert now[0]["click"] != now[50]["click"]
    assert all(0.0 < ne < 1.0 for report in now.values() for ne in report.values())
