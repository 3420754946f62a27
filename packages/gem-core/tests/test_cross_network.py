"""The DCN-V2 cross network (``model.interaction = "cross"``) against the formula written out in
float64, full and low-rank, on tokens that are not zeros; and what its layers can express."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from gem_core.model.cross_network import CrossNetworkInteraction


def reference(tokens: Tensor, module: CrossNetworkInteraction) -> Tensor:
    """``x_0 = LayerNorm(flatten(tokens))``, ``x_{l+1} = m * (x_l W_l^T + b_l) + x_l`` (``W = U V``
    for a low-rank layer) with ``m = x_0`` or, for the ``token`` multiplier, each token over its
    own RMS times its gain, then the MLP: plain products with ``module``'s weights."""
    norm = module.norm
    flat = tokens.flatten(1)
    centred = flat - flat.mean(dim=1, keepdim=True)
    x = centred / torch.sqrt(centred.pow(2).mean(dim=1, keepdim=True) + norm.eps)
    x = x * norm.weight + norm.bias
    x0 = x
    if module.multiplier is not None:
        gain = module.multiplier.gain.view(1, -1, 1)
        rms = torch.sqrt(tokens.pow(2).mean(dim=2, keepdim=True) + module.multiplier.eps)
        x0 = (tokens / rms * gain).flatten(1)
    for cross in module.crosses:
        if isinstance(cross.project, nn.Linear):
            weight, bias = cross.project.weight, cross.project.bias
        else:
            down, up = cross.project
            weight, bias = up.weight @ down.weight, up.bias
        x = x0 * (x @ weight.T + bias) + x
    for layer in module.mlp:
        if isinstance(layer, nn.Linear):
            x = x @ layer.weight.T + layer.bias
        elif isinstance(layer, nn.SiLU):
            x = x * torch.sigmoid(x)
    return x


@pytest.mark.parametrize("rank,multiplier", [(0, "flat"), (3, "flat"), (0, "token"),
                                             (3, "token")])
def test_matches_the_formula_in_float64(rank, multiplier):
    torch.manual_seed(rank)
    module = CrossNetworkInteraction(5, 6, layers=3, rank=rank, hidden=(16, 8),
                                     dropout=0.0, multiplier=multiplier).double()
    with torch.no_grad():  # LayerNorm starts at weight 1, bias 0: make them count
        module.norm.weight.uniform_(0.5, 1.5)
        module.norm.bias.normal_(0.0, 0.2)
        if module.multiplier is not None:
            module.multiplier.gain.uniform_(0.5, 2.0)
    # Tokens on scales 0.1 to 8, one of them zero in one sample (no match).
    tokens = torch.randn(7, 5, 6, dtype=torch.float64) * torch.tensor(
        [0.1, 8.0, 1.0, 0.5, 2.0], dtype=torch.float64).view(1, 5, 1)
    tokens[2, 1] = 0.0
    out = module(tokens)
    assert out.shape == (7, 8) and module.out_dim == 8
    torch.testing.assert_close(out, reference(tokens, module), rtol=1e-12, atol=1e-12)
    if rank:
        assert all(cross.project[0].out_features == rank for cross in module.crosses)


def test_two_layers_hold_a_product_of_three_inputs():
    """Two cross layers hold ``a * b * c`` of three inputs exactly (an order-3 cross) with a
    linear read-out: weights set by hand, no MLP nonlinearity involved."""
    module = CrossNetworkInteraction(3, 1, layers=2, rank=0, hidden=(), dropout=0.0).double()
    with torch.no_grad():
        module.norm = nn.Identity()
        first, second = (cross.project for cross in module.crosses)
        first.weight.zero_(), first.bias.zero_()
        first.weight[0, 1] = 1.0  # x1[0] = a + a * b
        second.weight.zero_(), second.bias.zero_()
        second.weight[2, 0] = 1.0  # x2[2] = c + c * (a + a * b)
    abc = torch.randn(50, 3, 1, dtype=torch.float64)
    a, b, c = abc[:, 0, 0], abc[:, 1, 0], abc[:, 2, 0]
    out = module(abc)
    torch.testing.assert_close(out[:, 2] - c - c * a, a * b * c)


def test_token_multiplier_gives_every_token_one_scale_in_the_products():
    """With ``multiplier = "token"`` a quiet token's own part of the products is as large as a
    loud one's (each token over its own RMS); under the LayerNorm-ed multiplier the quiet token
    is divided by the loud one's size (and its position carries the loud token's mean)."""
    torch.manual_seed(0)
    scales = torch.tensor([0.1, 10.0], dtype=torch.float64).view(1, 2, 1)
    tokens = torch.randn(64, 2, 4, dtype=torch.float64) * scales
    without_quiet = tokens.clone()
    without_quiet[:, 0] = 0.0
    own = {}
    for multiplier in ("flat", "token"):
        module = CrossNetworkInteraction(2, 4, layers=1, rank=0, hidden=(),
                                         dropout=0.0, multiplier=multiplier).double()
        with torch.no_grad():
            module.crosses[0].project.weight.zero_()
            module.crosses[0].project.bias.fill_(1.0)  # x_1 = m + x_0

        def multiplied(x, module=module):
            return (module(x) - module.norm(x.flatten(1))).view(-1, 2, 4)[:, 0]
        # What the quiet token itself puts into its position's product.
        own[multiplier] = (multiplied(tokens) - multiplied(without_quiet)).pow(2).mean().sqrt()
    assert own["flat"] < 0.05
    torch.testing.assert_close(own["token"], torch.tensor(1.0, dtype=torch.float64),
                               rtol=5e-3, atol=0)  # eps 1e-5 against 0.01
    with pytest.raises(ValueError, match="expected 'flat' or 'token'"):
        CrossNetworkInteraction(2, 4, layers=1, rank=0, hidden=(), dropout=0.0,
                                multiplier="batch")
