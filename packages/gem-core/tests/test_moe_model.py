"""MoE inside the GEM model: which MLPs become mixtures, the analytic FLOP count against
FlopCounterMode (active experts only), the generic auxiliary-loss and step-stats methods, and
the ``tiny-moe`` preset."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from gem_core.config import MoeConfig, load_config
from gem_core.errors import GemConfigError
from gem_core.flops import TRAIN_FACTOR
from gem_core.model.moe import MixtureOfExperts, moe_layers
from gem_core.testing.models import small_model, synthetic_batch
from gem_core.train.loss import mean_loss

# capacity_factor 0: nothing dropped, so every routed assignment is computed and counted.
# reference impl: FlopCounterMode does not see torch._grouped_mm (it counts it as 0).
VARIANTS = {
    "sequence": dict(moe=MoeConfig(num_experts=4, top_k=2, capacity_factor=0.0,
                                   impl="reference")),
    "sequence-wukong-shared": dict(
        interaction="wukong", wukong_fmb_tokens=3, wukong_lcb_tokens=2, pma_queries=2,
        moe=MoeConfig(num_experts=3, top_k=1, capacity_factor=0.0, shared_expert=True,
                      where=("sequence", "wukong"), impl="reference")),
}


@pytest.fixture(scope="module")
def data():
    return synthetic_batch(12, max_seq_len=48, seed=0)


_model = small_model


@pytest.mark.parametrize("name", VARIANTS)
def test_forward_and_training_flops_match_flop_counter(data, name):
    schema, batch = data
    model = _model(schema, **VARIANTS[name])
    layers = moe_layers(model)
    assert len(layers) == (2 if name == "sequence" else 4)  # 2 blocks (+ 2 Wukong layers)
    with FlopCounterMode(display=False) as counter:
        model(batch)
    analytic = sum(model.flops_by_module(batch.seq_lengths(), dense=True).values())
    assert analytic == pytest.approx(counter.get_total_flops(), rel=0.01)
    with FlopCounterMode(display=False) as counter:
        out = model(batch)
        sum(logit.sum() for logit in out.values()).backward()
    assert TRAIN_FACTOR * analytic == pytest.approx(counter.get_total_flops(), rel=0.01)


@pytest.mark.parametrize("where", [("sequence",), ("sequence", "wukong")])
def test_grouped_path_is_counted_too(data, where):
    """FlopCounterMode has no formula for torch._grouped_mm; gem registers one."""
    import attrs

    schema, batch = data
    variant = VARIANTS["sequence-wukong-shared"]
    model = _model(schema, **{**variant, "moe": attrs.evolve(variant["moe"], impl="grouped",
                                                             where=where)})
    with FlopCounterMode(display=False) as counter:
        out = model(batch)
        sum(logit.sum() for logit in out.values()).backward()
    assert {layer.experts.last_grouped_backend for _, layer in moe_layers(model)} \
        == {"grouped_mm"}
    analytic = sum(model.flops_by_module(batch.seq_lengths(), dense=True).values())
    assert TRAIN_FACTOR * analytic == pytest.approx(counter.get_total_flops(), rel=0.01)


def test_moe_costs_top_k_dense_mlps_not_all_experts(data):
    schema, batch = data
    lengths = batch.seq_lengths()
    dense = _model(schema).flops_by_module(lengths)["tower.linear"]
    two = _model(schema, moe=MoeConfig(num_experts=4, top_k=2)).flops_by_module(lengths)
    eight = _model(schema, moe=MoeConfig(num_experts=8, top_k=2)).flops_by_module(lengths)
    tokens, dim, hidden = int(lengths.sum()), 16, 32
    mlp = 2 * tokens * (dim * 2 * hidden + hidden * dim)
    router = 2 * tokens * dim
    assert two["tower.linear"] == dense + 2 * (mlp + 4 * router)  # 2 layers, one extra MLP
    assert eight["tower.linear"] - two["tower.linear"] == 2 * 4 * router  # only the router grows


def test_auxiliary_losses_and_stats_come_from_the_last_training_forward(data):
    schema, batch = data
    plain = _model(schema)
    plain(batch)
    assert plain.auxiliary_losses() == {} and plain.step_stats() == {}
    model = _model(schema, **VARIANTS["sequence-wukong-shared"])
    model.eval()
    model(batch)
    assert model.auxiliary_losses() == {}
    model.train()
    logits = model(batch)
    aux = model.auxiliary_losses()
    assert sorted(aux) == sorted(f"{name}.load_balance" for name, _ in moe_layers(model))
    (mean_loss(logits, batch, schema.tasks) + sum(aux.values())).backward()
    stats = model.step_stats()
    summary = model.summarize_step_stats(stats)
    tokens = summary["moe_tokens_per_expert"]
    assert sum(tokens["tower.blocks.0.mlp"]) == int(batch.seq_lengths().sum())  # top-1
    assert sum(tokens["interaction.layers.0.fmb.mlp"]) == batch.batch_size
    assert summary["moe_dropped_tokens"] == 0
    assert summary["moe_load_max_over_mean_worst"] >= 1.0


def test_grouped_and_reference_models_agree(data):
    schema, batch = data
    config = VARIANTS["sequence-wukong-shared"]["moe"]
    results = []
    for impl in ("reference", "grouped"):
        import attrs

        model = _model(schema, **{**VARIANTS["sequence-wukong-shared"],
                                  "moe": attrs.evolve(config, impl=impl, capacity_factor=1.0)})
        logits = model(batch)
        mean_loss(logits, batch, schema.tasks).backward()
        results.append((logits, {n: p.grad for n, p in model.named_parameters()}))
    (want, want_grads), (got, got_grads) = results
    for task in want:
        torch.testing.assert_close(got[task], want[task], rtol=1e-5, atol=1e-6)
    for name, grad in want_grads.items():
        if grad is None:
            assert got_grads[name] is None, name
        else:
            torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_tiny_moe_preset_is_tiny_with_moe():
    tiny, moe = load_config(preset="tiny"), load_config(preset="tiny-moe")
    assert not tiny.model.moe.enabled  # existing presets unchanged
    assert moe.model.moe.num_experts == 4 and moe.model.moe.where == ("sequence",)
    import attrs

    assert attrs.evolve(moe.model, moe=MoeConfig()) == tiny.model
    assert moe.train == tiny.train and moe.data == tiny.data


def test_moe_config_errors_name_the_key():
    with pytest.raises(GemConfigError, match=r"top_k \(3\) must be <= num_experts \(2\)"):
        load_config(overrides=["model.moe.num_experts=2", "model.moe.top_k=3"])
    with pytest.raises(GemConfigError, match="moe.where includes 'wukong' but model.interaction"):
        load_config(overrides=["model.moe.num_experts=2", 'model.moe.where=["wukong"]'])
    with pytest.raises(GemConfigError,
                       match="model.moe.where must be one of sequence, wukong; got 'heads'"):
        load_config(overrides=["model.moe.num_experts=2", 'model.moe.where=["heads"]'])
    with pytest.raises(GemConfigError, match="model.moe.impl must be one of reference, grouped"):
        load_config(overrides=["model.moe.impl=fast"])
    assert isinstance(load_config(preset="tiny-moe").model.moe, MoeConfig)
    assert MixtureOfExperts  # the model module exposes the layer class
