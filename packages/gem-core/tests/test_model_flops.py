"""The analytic FLOP count of the model against torch's FlopCounterMode (matmuls only).

The reference attention backend computes each sample's full query x key rectangle, so the
analytic count is taken with ``dense=True`` here; training counts use the masked pairs.
"""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from gem_core.flops import TRAIN_FACTOR
from gem_core.testing.models import small_model, synthetic_batch

VARIANTS = {
    "default": {},
    "pma-wukong-cross": dict(pma_queries=3, interaction="wukong", cross_attention=True,
                             wukong_fmb_tokens=3, wukong_lcb_tokens=2),
    "target-all-recent-esmm": dict(pma_queries=2, target_queries="all", target_history=8,
                                   multitask="esmm", window=8, candidate_bias=True),
    "dlrm-baseline": dict(num_layers=0, target_attention=False),
    "attention-gate-multistage": dict(attention_gate=True, pma_queries=2,
                                      downstream_history="events"),
    "cross-network": dict(interaction="cross", cross_layers=2),
    "cross-network-low-rank": dict(interaction="cross", cross_layers=3, cross_rank=4,
                                   cross_multiplier="token", token_norm="sample"),
    "dense-per-feature-cross-attention": dict(dense_tokens="per_feature", cross_attention=True,
                                              interaction="cross", cross_layers=1,
                                              token_norm="batch"),
    "cross-branch-beside-wukong": dict(interaction="wukong", cross_branch=True,
                                       cross_branch_norm="cap", cross_layers=2),
    "cross-branch-on-request-tokens": dict(interaction="dot", cross_branch=True,
                                           cross_branch_tokens="request", cross_rank=4),
    "cross-branch-skipping-a-feature": dict(interaction="dot", cross_branch=True,
                                            cross_branch_skip=("context",)),
    "target-match-windows": dict(target_match=8, action_feature="action",
                                 target_match_action_window=32, target_match_max_age_s=1e6),
    "target-match-engaged-limit": dict(target_match=8, action_feature="action",
                                       target_match_action_window=32,
                                       target_match_engaged_limit=3,
                                       target_match_engaged_rank="gate"),
    "target-match-latest-by-action": dict(target_match=8, action_feature="action",
                                          target_match_latest=True),
    "id-bias-beside-candidate-bias": dict(candidate_bias=True, id_bias=("item", "category")),
}


@pytest.fixture(scope="module")
def data():
    return synthetic_batch(12, max_seq_len=48, seed=0)


_model = small_model


@pytest.mark.parametrize("name", VARIANTS)
def test_forward_count_matches_flop_counter(data, name):
    schema, batch = data
    model = _model(schema, **VARIANTS[name])
    with FlopCounterMode(display=False) as counter:
        model(batch)
    analytic = sum(model.flops_by_module(batch.seq_lengths(), dense=True).values())
    assert analytic == pytest.approx(counter.get_total_flops(), rel=0.01)


def test_training_count_is_three_forwards_within_one_percent(data):
    schema, batch = data
    model = _model(schema, **VARIANTS["pma-wukong-cross"])
    with FlopCounterMode(display=False) as counter:
        out = model(batch)
        sum(logit.sum() for logit in out.values()).backward()
    analytic = TRAIN_FACTOR * sum(model.flops_by_module(batch.seq_lengths(), dense=True).values())
    assert analytic == pytest.approx(counter.get_total_flops(), rel=0.01)


def test_trainer_keys_and_padding_is_never_cheaper(data):
    schema, batch = data
    model = _model(schema, pma_queries=2, window=4)
    counts = model.flops(batch.seq_lengths())
    assert set(counts) == {"total", "attention", "padded_total", "padded_attention"}
    assert counts["padded_attention"] > counts["attention"] > 0
    assert counts["padded_total"] > counts["total"] > counts["attention"]
    forward = model.flops_by_module(batch.seq_lengths())
    assert counts["total"] == TRAIN_FACTOR * sum(forward.values())
    # Equal lengths and no window: nothing to save but the causal half.
    same = torch.full((4,), 10)
    assert model.flops(same)["padded_total"] >= model.flops(same)["total"]


def test_target_match_count_is_exact_with_several_candidates_per_request():
    schema, batch = synthetic_batch(6, max_seq_len=40, seed=1, candidates=3)
    model = _model(schema, target_match=8, action_feature="action",
                   target_match_action_window=24, target_match_latest=True)
    with FlopCounterMode(display=False) as counter:
        model(batch)
    counts = model.flops_by_module(batch.seq_lengths(), batch.candidate_counts(), dense=True)
    measured = counter.get_flop_counts()["GEMModel.target_match"]
    assert counts["target_match"] == sum(measured.values())
    assert sum(counts.values()) == pytest.approx(counter.get_total_flops(), rel=0.01)
