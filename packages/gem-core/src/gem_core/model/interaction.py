"""Feature interaction above the towers: pairwise dot products of tokens, then an MLP."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gem_core.flops import linear_layer_flops


def log_magnitude(tokens: Tensor) -> Tensor:
    """``tokens`` ``(N, d)`` each rescaled from RMS ``r`` to RMS ``log(1 + r)``: the same
    direction, a size that still grows with ``r`` but no longer by orders of magnitude.

    For tokens that sum a variable number of events (target match, attribute attention): the
    interaction's LayerNorm normalises all tokens and their pairwise products together, and
    one token a hundred times larger than the others leaves them near zero after it."""
    rms = tokens.pow(2).mean(dim=-1, keepdim=True).add(1e-12).sqrt()
    return tokens * (torch.log1p(rms) / rms)


def mlp_layers(width: int, hidden: tuple[int, ...], dropout: float) -> tuple[list[nn.Module], int]:
    """The MLP above every interaction: ``Linear -> SiLU -> Dropout`` per width of ``hidden``,
    from ``width`` inputs; returns the layers and the output width (``width`` if none)."""
    layers: list[nn.Module] = []
    for size in hidden:
        layers += [nn.Linear(width, size), nn.SiLU(), nn.Dropout(dropout)]
        width = size
    return layers, width


class DotInteractionMLP(nn.Module):
    """DLRM-style: the upper triangle of the token Gram matrix, concatenated with the tokens."""

    def __init__(self, num_tokens: int, dim: int, hidden: tuple[int, ...], dropout: float) -> None:
        super().__init__()
        self.num_tokens, self.dim = num_tokens, dim
        rows, cols = torch.triu_indices(num_tokens, num_tokens, offset=1)
        self.register_buffer("pair_rows", rows, persistent=False)
        self.register_buffer("pair_cols", cols, persistent=False)
        width = num_tokens * dim + rows.numel()
        layers, self.out_dim = mlp_layers(width, hidden, dropout)
        self.mlp = nn.Sequential(nn.LayerNorm(width), *layers)

    def forward(self, tokens: Tensor) -> Tensor:
        gram = torch.bmm(tokens, tokens.transpose(1, 2))
        pairs = gram[:, self.pair_rows, self.pair_cols]
        return self.mlp(torch.cat([tokens.flatten(1), pairs], dim=1))

    def flops(self, batch: int) -> int:
        """Forward FLOPs (matmuls only): the Gram matrix and the MLP."""
        gram = 2 * batch * self.num_tokens * self.num_tokens * self.dim
        return gram + linear_layer_flops(self.mlp, batch)
