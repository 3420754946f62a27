import copy

import pytest
import torch

from gem_precision.activation_stash import (ActivationStash, count_saved_bytes, dequantize,
                                            install_stash, quantize)
from gem_precision.fp8 import Float8Recipe

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


def saved_bytes_and_grads(model, batch, loss_fn, stash=None):
    hooks, counted = count_saved_bytes()
    with hooks:
        loss = loss_fn(model(batch), batch)
    loss.backward()
    total = counted["bytes"]
    if stash is not None:  # what the stash holds never reached the outer counting hooks
        total += stash.stats.stored_bytes + stash.stats.kept_bytes
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return total, float(loss.detach()), grads


def test_stash_cuts_saved_bytes_and_keeps_gradients_close(make_model, batches, loss_fn):
    model = make_model()
    stashed = copy.deepcopy(model)
    stash = ActivationStash("row", min_numel=1024)
    install_stash(stashed, stash, ALL_KINDS)
    base_bytes, base_loss, base_grads = saved_bytes_and_grads(model, batches[0], loss_fn)
    low_bytes, low_loss, low_grads = saved_bytes_and_grads(stashed, batches[0], loss_fn, stash)
    assert stash.stats.quantized_tensors > 0
    assert low_bytes <= 0.6 * base_bytes  # the goal: at least 40 % fewer saved bytes
    assert low_loss == base_loss  # the forward is untouched; only what backward reads changes
    for name, g in base_grads.items():
        if g.norm() > 0:
            assert (low_grads[name] - g).norm() / g.norm() < 0.1, name


def test_stash_is_a_recipe_option_and_only_hooks_chosen_kinds(make_model, batches, loss_fn):
    recipe = Float8Recipe("rowwise")
    model = recipe.convert(make_model(), None, {"activation_fp8": True,
                                                "activation_modules": ["norm"]})
    loss_fn(model(batches[0]), batches[0]).backward()
    norm_only = recipe.stash.stats.quantized_tensors
    assert norm_only > 0
    recipe_all = Float8Recipe("rowwise")
    model = recipe_all.convert(make_model(), None, {"activation_fp8": True,
                                                    "activation_modules": ALL_KINDS})
    loss_fn(model(batches[0]), batches[0]).backward()
    assert recipe_all.stash.stats.quantized_tensors > norm_only
    with torch.no_grad():  # nothing is saved without grad: the stash stays idle
        before = recipe_all.stash.stats.quantized_tensors
        model(batches[0])
        assert recipe_all.stash.stats.quantized_tensors == before
