import pytest
import torch

from gem_precision.activation_stash import dequantize, quantize
from gem_precision.fp8 import Float8Recipe
from gem_precision.stash_report import compare_saved_bytes

ALL_KINDS = ["linear", "norm", "swiglu", "sequence_block", "target_attention", "interaction"]


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_quantize_round_trip_within_the_e4m3_bound(granularity):
    torch.manual_seed(0)
    x = torch.randn(64, 48) * torch.logspace(-3, 3, 48)  # columns of very different sizes
    q = quantize(x, granularity)
    assert q.data.dtype == torch.float8_e4m3fn and q.nbytes < x.numel() * 4 / 3
    back = dequantize(q)
    assert back.dtype == x.dtype
    # e4m3: relative rounding error <= 2^-4 for normals; subnormals (below 2^-6 of the scaled
    # range) have an absolute step of 2^-9 in scaled units
    amax = x.abs().amax(dim=-1, keepdim=True) if granularity == "row" else x.abs().amax()
    bound = x.abs() * 2 ** -4 + amax / 448 * 2 ** -9
    assert torch.all((back - x).abs() <= bound * 1.001)


@pytest.mark.parametrize("scaling", ["row", "tensor"])
def test_stash_cuts_saved_bytes_and_keeps_gradients_close(make_model, batches, loss_fn, scaling):
    report = compare_saved_bytes(make_model(), batches[0], loss_fn, scaling=scaling,
                                 kinds=ALL_KINDS)
    assert report.quantized_tensors > 0
    assert report.saved_fraction >= 0.4  # the goal: at least 40 % fewer saved bytes
    # e4m3 keeps 3 mantissa bits: gradients move by a few percent, not more
    assert 0 < report.grad_rel_diff < 0.05
    diffs = report.grad_rel_diffs
    scorer = {n: d for n, d in diffs.items() if n.startswith("attribute_attention.")}
    assert scorer and max(d for n, d in diffs.items() if n not in scorer) < 0.15
    # attribute attention's scorer: each gradient is a sum over (candidate, event) pairs of
    # <value, upstream gradient> terms of both signs, so the e4m3 error of the stashed inputs
    # of its value and output projections does not cancel with the sum (measured 0.08-0.18)
    weight_bias = scorer.pop("attribute_attention.weights.bias")
    assert max(scorer.values()) < 0.3
    # The most cancelling of those sums: one number per shared attribute, every slot's
    # <value, upstream gradient> added up. Measured 0.23 before the presets rescaled the match
    # tokens (model.match_token_scale = log, whose Jacobian takes out the upstream gradient's
    # component along the token), 0.53 / 0.56 (row / tensor scaling) since; the whole gradient
    # moves by 0.014.
    assert weight_bias < 0.75


def test_stash_is_a_recipe_option_and_only_hooks_chosen_kinds(make_model, batches, loss_fn,
                                                              recipe_options):
    recipe = Float8Recipe("rowwise")
    model = recipe.convert(make_model(), None, recipe_options(
        "fp8-rowwise", activation_fp8=True, activation_modules=["norm"]))
    loss_fn(model(batches[0]), batches[0]).backward()
    norm_only = recipe.stash.stats.quantized_tensors
    assert norm_only > 0
    recipe_all = Float8Recipe("rowwise")
    model = recipe_all.convert(make_model(), None, recipe_options(
        "fp8-rowwise", activation_fp8=True, activation_modules=ALL_KINDS))
    loss_fn(model(batches[0]), batches[0]).backward()
    assert recipe_all.stash.stats.quantized_tensors > norm_only
    with torch.no_grad():  # nothing is saved without grad: the stash stays idle
        before = recipe_all.stash.stats.quantized_tensors
        model(batches[0])
        assert recipe_all.stash.stats.quantized_tensors == before


def test_stash_composes_with_activation_checkpointing(make_model, batches, loss_fn, recipe_options):
    checkpointing = pytest.importorskip("gem_parallel.checkpointing")  # another package
    batch = batches[0]
    reference = make_model()
    loss_fn(reference(batch), batch).backward()
    recipe = Float8Recipe("rowwise")
    model = recipe.convert(make_model(), None, recipe_options(
        "fp8-rowwise", exclude=["*"], activation_fp8=True, activation_modules=["sequence_block"]))
    for block in model.tower.blocks:
        checkpointing.checkpoint_module(block)  # as `full` does, after convert
    loss_fn(model(batch), batch).backward()
    assert recipe.stash.stats.quantized_tensors > 0
    for p, r in zip(model.parameters(), reference.parameters()):
        if r.grad is not None and r.grad.norm() > 0:
            assert (p.grad - r.grad).norm() / r.grad.norm() < 0.1
