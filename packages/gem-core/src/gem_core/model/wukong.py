"""Wukong interaction (Zhang et al., 2024, "Wukong: towards a scaling law for large-scale
recommendation"): a stack of layers, each a factorization-machine block (FMB) and a linear
compress block (LCB) side by side, with a residual and LayerNorm; then an MLP on the flattened
tokens. Stacking layers raises the interaction order (layer i captures up to 2^i-order terms)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gem_core.config import MoeConfig
from gem_core.flops import linear_layer_flops
from gem_core.model.interaction import mlp_layers
from gem_core.model.moe import build_moe, mlp_flops


class FactorizationMachineBlock(nn.Module):
    """The optimised FM: ``X (X^T Y)`` with a learned ``(n, k)`` projection ``Y`` costs
    ``O(n d k)`` instead of the ``O(n^2 d)`` Gram matrix ``X X^T``, and keeps the rank-k part of
    every pairwise interaction; an MLP (or a mixture of MLP experts routed per sample, given
    ``moe``) then maps the ``n x k`` interactions to ``n_F`` tokens."""

    def __init__(self, num_tokens: int, dim: int, rank: int, out_tokens: int, hidden: int,
                 moe: MoeConfig | None = None) -> None:
        super().__init__()
        self.out_tokens, self.dim = out_tokens, dim
        self.compress = nn.Linear(num_tokens, rank, bias=False)  # Y, applied along tokens
        self.norm = nn.LayerNorm(num_tokens * rank)
        self.mlp = (build_moe(moe, "mlp", num_tokens * rank, hidden, out_tokens * dim)
                    if moe is not None else
                    nn.Sequential(nn.Linear(num_tokens * rank, hidden), nn.SiLU(),
                                  nn.Linear(hidden, out_tokens * dim)))

    def forward(self, x: Tensor) -> Tensor:
        projected = self.compress(x.transpose(1, 2))  # (B, d, k) = X^T Y
        interactions = x @ projected  # (B, n, k) = X X^T Y
        out = self.mlp(self.norm(interactions.flatten(1)))
        return out.view(x.shape[0], self.out_tokens, self.dim)

    def flops(self, batch: int) -> int:
        tokens, rank = self.compress.in_features, self.compress.out_features
        # X^T Y runs on d rows per sample; X (X^T Y) is a batched (n, d) x (d, k) product.
        return (2 * batch * self.dim * tokens * rank + 2 * batch * tokens * self.dim * rank
                + mlp_flops(self.mlp, batch))


class LinearCompressBlock(nn.Module):
    """``W X``: ``n_L`` learned linear recombinations of the input tokens (no interaction,
    it keeps the lower-order terms flowing to the next layer)."""

    def __init__(self, num_tokens: int, out_tokens: int) -> None:
        super().__init__()
        self.mix = nn.Linear(num_tokens, out_tokens, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.mix(x.transpose(1, 2)).transpose(1, 2)

    def flops(self, batch: int, dim: int) -> int:
        return 2 * batch * dim * self.mix.in_features * self.mix.out_features


class WukongLayer(nn.Module):
    """``LN(concat(FMB(X), LCB(X)) + residual(X))``; the residual is a learned token mix when the
    layer changes the number of tokens."""

    def __init__(self, num_tokens: int, dim: int, rank: int, fmb_tokens: int, lcb_tokens: int,
                 hidden: int, moe: MoeConfig | None = None) -> None:
        super().__init__()
        out_tokens = fmb_tokens + lcb_tokens
        self.fmb = FactorizationMachineBlock(num_tokens, dim, rank, fmb_tokens, hidden, moe)
        self.lcb = LinearCompressBlock(num_tokens, lcb_tokens)
        self.residual = (None if out_tokens == num_tokens
                         else LinearCompressBlock(num_tokens, out_tokens))
        self.norm = nn.LayerNorm(dim)
        self.out_tokens = out_tokens

    def forward(self, x: Tensor) -> Tensor:
        skip = x if self.residual is None else self.residual(x)
        out = torch.cat([self.fmb(x), self.lcb(x)], dim=1)
        return self.norm(out + skip)

    def flops(self, batch: int, dim: int) -> int:
        count = self.fmb.flops(batch) + self.lcb.flops(batch, dim)
        return count + (0 if self.residual is None else self.residual.flops(batch, dim))


class WukongInteraction(nn.Module):
    """``(B, n, d)`` tokens -> ``(B, out_dim)``: Wukong layers, then an MLP (``hidden`` widths).
    ``moe``: every factorization-machine block's MLP is a mixture of experts."""

    def __init__(self, num_tokens: int, dim: int, *, layers: int, rank: int, fmb_tokens: int,
                 lcb_tokens: int, mlp_dim: int, hidden: tuple[int, ...], dropout: float,
                 moe: MoeConfig | None = None) -> None:
        super().__init__()
        self.dim = dim
        stack = []
        width = num_tokens
        for _ in range(layers):
            stack.append(WukongLayer(width, dim, rank, fmb_tokens, lcb_tokens, mlp_dim, moe))
            width = stack[-1].out_tokens
        self.layers = nn.Sequential(*stack)
        mlp, self.out_dim = mlp_layers(width * dim, hidden, dropout)
        self.mlp = nn.Sequential(*mlp)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.mlp(self.layers(tokens).flatten(1))

    def flops(self, batch: int) -> int:
        """Forward FLOPs (matmuls only)."""
        return (sum(layer.flops(batch, self.dim) for layer in self.layers)
                + linear_layer_flops(self.mlp, batch))
