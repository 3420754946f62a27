"""The DCN-V2 cross network (``model.interaction = "cross"``) against the formula written out in
float64, full and low-rank, on tokens that are not zeros; and what its layers can express."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from gem_core.model.cross_network import CrossNetworkInteraction


def reference(tokens: Tensor, module: CrossNetworkInteraction) -> Tensor:
    """``x0 = LayerNorm(flatten(tokens))``, ``x_{l+1} = x0 * (x_l W_l^T + b_l) + x_l`` (``W = U V``
    for a low-rank layer), then the MLP: plain products with ``module``'s weights."""
    norm = module.norm
    flat = tokens.flatten(1)
    centred = flat - flat.mean(dim=1, keepdim=True)
    x0 = centred / torch.sqrt(centred.pow(2).mean(dim=1, keepdim=True) + norm.eps)
    x0 = x0 * norm.weight + norm.bias
    x = x0
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


@pytest.mark.parametrize("rank", [0, 3])
def test_matches_the_formula_in_float64(rank):
    torch.manual_seed(rank)
    module = CrossNetworkInteraction(5, 6, layers=3, rank=rank, hidden=(16, 8),
                                     dropout=0.0).double()
    with torch.no_grad():  # LayerNorm starts at weight 1, bias 0: make them count
        module.norm.weight.uniform_(0.5, 1.5)
        module.norm.bias.normal_(0.0, 0.2)
    tokens = torch.randn(7, 5, 6, dtype=torch.float64)
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
