import pytest
import torch
from torch import nn

from gem_core.errors import GemConfigError
from gem_precision.float8 import float8_linear_class
from gem_precision.fp8 import Float8Recipe
from gem_precision.selection import fp8_candidates

# tiny's linears that suit FP8: both dims multiples of 16 and >= 32, not a head
TOWER = [f"tower.blocks.{i}.{n}" for i in range(2) for n in ("qkv", "proj", "mlp.gate_up",
                                                              "mlp.down")]
EXPECTED = set(TOWER + ["target_attention.query", "target_attention.key_value",
                        "target_attention.proj", "target_match.values", "target_match.proj",
                        "attribute_attention.values", "attribute_attention.proj",
                        "interaction.mlp.4"])


def linear_types(model):
    return {n: type(m) for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def test_candidates_follow_shape_head_and_exclude_rules(make_model):
    model = make_model()
    chosen, skipped = fp8_candidates(model, exclude=(), min_dim=32)
    assert set(chosen) == EXPECTED
    assert skipped["heads.click"] == "task head"
    assert "not divisible by 16" in skipped["interaction.mlp.1"]  # 207 inputs
    assert "not divisible by 16" in skipped["dense_proj"]
    chosen, skipped = fp8_candidates(model, exclude=("tower.blocks.1", "*.proj"), min_dim=64)
    assert set(chosen) == {"interaction.mlp.4"}  # the only 64+ x 64+ layer left
    assert skipped["tower.blocks.1.qkv"] == "excluded by 'tower.blocks.1'"
    assert "below min_dim 64" in skipped["tower.blocks.0.mlp.gate_up"]
    assert skipped["tower.blocks.0.proj"] == "excluded by '*.proj'"


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_only_filtered_linears_are_swapped_and_the_rest_keep_fp32(make_model, recipe,
                                                                  recipe_options):
    options = recipe_options(f"fp8-{recipe}", exclude=["tower.blocks.0"])
    model = Float8Recipe(recipe).convert(make_model(), None, options)
    float8_linear = float8_linear_class()
    types = linear_types(model)
    swapped = {n for n, t in types.items() if t is float8_linear}
    assert swapped == EXPECTED - {n for n in TOWER if n.startswith("tower.blocks.0")}
    assert all(types[n] is nn.Linear for n in types if n not in swapped)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights
    for module in model.modules():  # embeddings and norms untouched
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag, nn.RMSNorm, nn.LayerNorm)):
            assert type(module) in (nn.Embedding, nn.EmbeddingBag, nn.RMSNorm, nn.LayerNorm)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_forward_and_backward_stay_close_to_fp32(make_model, batches, loss_fn, recipe,
                                                     recipe_options):
    reference, low = make_model(), make_model()
    low = Float8Recipe(recipe).convert(low, None, recipe_options(f"fp8-{recipe}"))
    batch = batches[0]
    ref_logits, low_logits = reference(batch), low(batch)
    loss_fn(ref_logits, batch).backward()
    loss_fn(low_logits, batch).backward()
    for task in ref_logits:
        # FP8 e4m3 keeps 3 mantissa bits (about 4 % per element); over 12 layers the logits
        # drift by a few percent of their spread
        err = (low_logits[task] - ref_logits[task]).norm() / ref_logits[task].norm()
        assert 0 < err < 0.1
    ref_grads = dict(reference.named_parameters())
    scorer_diff, scorer_norm = 0.0, 0.0
    for name, p in low.named_parameters():
        g, r = p.grad, ref_grads[name].grad
        if r is None or r.norm() == 0:
            continue
        if name.startswith("attribute_attention."):
            # Attribute attention's scorer, as one vector: each of its gradients is a sum over
            # (candidate, event) slots of terms of both signs, and the smallest (the weights'
            # bias, one number per shared attribute) nearly cancels, so one cast moves it by
            # 0.1-1.4 of itself while the scorer's gradient as a whole moves by 0.05-0.08
            # (measured with and without the presets' match-token rescaling and candidate bias).
            scorer_diff += float((g - r).pow(2).sum())
            scorer_norm += float(r.pow(2).sum())
            continue
        # gradients go through e4m3 (rowwise) or e5m2 (tensorwise) casts: 20 % relative
        assert ((g - r).norm() / r.norm()) < 0.2, name
    assert scorer_norm > 0 and (scorer_diff / scorer_norm) ** 0.5 < 0.2


def test_unknown_and_contradictory_options_are_errors(recipe_options):
    # gem-core structures [precision.options] into the class the spec declares
    with pytest.raises(GemConfigError, match="unknown key 'precision.options.exlude'"):
        recipe_options("fp8-rowwise", exlude=["heads"])
    with pytest.raises(GemConfigError, match="fsdp_float8_all_gather needs tensorwise"):
        recipe_options("fp8-rowwise", fsdp_float8_all_gather=True)
    with pytest.raises(GemConfigError, match="fsdp_float8_all_gather needs tensorwise"):
        recipe_options("fp8-auto", fsdp_float8_all_gather=True)  # its recipe: rowwise
    assert recipe_options("fp8-tensorwise", fsdp_float8_all_gather=True).fsdp_float8_all_gather
    assert recipe_options("fp8-auto", recipe="tensorwise", fsdp_float8_all_gather=True)
    # gem-core's validators, keyed by the dotted name: the bad entry and the allowed ones
    with pytest.raises(GemConfigError, match=r"precision.options.activation_modules must be one "
                                             r"of linear, .*; got 'mlp'"):
        recipe_options("fp8-rowwise", activation_modules=["mlp"])
