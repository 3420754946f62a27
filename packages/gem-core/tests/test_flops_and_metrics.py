import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gem_core.attention import AttentionParams
from gem_core.attention.masks import self_attention_mask
from gem_core.flops import causal_window_pairs
from gem_core.metrics import calibration, normalized_entropy, roc_auc


@settings(max_examples=60, deadline=None)
@given(length=st.integers(0, 40), window=st.one_of(st.none(), st.integers(0, 50)))
def test_closed_form_pair_count_equals_the_mask(length, window):
    params = AttentionParams(causal=True, window=window)
    expected = int(self_attention_mask(length, 0, params).sum())
    assert int(causal_window_pairs(torch.tensor([length]), window)[0]) == expected


def _brute_force_auc(scores, labels):
    pos = [s for s, label in zip(scores, labels) if label == 1]
    neg = [s for s, label in zip(scores, labels) if label == 0]
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


@settings(max_examples=60, deadline=None)
@given(data=st.lists(st.tuples(st.integers(-3, 3), st.booleans()), min_size=2, max_size=30))
def test_auc_matches_pair_counting_with_ties(data):
    scores = [float(s) for s, _ in data]
    labels = [int(label) for _, label in data]
    if len(set(labels)) < 2:
        assert math.isnan(roc_auc(torch.tensor(scores), torch.tensor(labels, dtype=torch.float)))
        return
    got = roc_auc(torch.tensor(scores), torch.tensor(labels, dtype=torch.float))
    assert got == pytest.approx(_brute_force_auc(scores, labels), abs=1e-12)


def test_ne_is_one_for_the_base_rate_and_lower_for_a_better_model():
    labels = torch.tensor([1.0, 0, 0, 0, 1, 0, 0, 0])
    base = torch.full((8,), math.log(0.25 / 0.75))
    assert normalized_entropy(base, labels) == pytest.approx(1.0, abs=1e-12)
    better = torch.where(labels == 1, torch.tensor(1.0), torch.tensor(-2.0))
    assert normalized_entropy(better, labels) < 1.0
    # By hand: cross-entropy / entropy of p = 0.25.
    p = torch.sigmoid(better.double())
    ce = -(labels * p.log() + (1 - labels) * (1 - p).log()).mean().item()
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert normalized_entropy(better, labels) == pytest.approx(ce / h, rel=1e-12)


def test_calibration_is_mean_prediction_over_rate():
    labels = torch.tensor([1.0, 0, 0, 0])
    logits = torch.full((4,), math.log(0.5 / 0.5))
    assert calibration(logits, labels) == pytest.approx(2.0)
