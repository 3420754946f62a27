"""A cross network over the tokens (DCN-V2, Wang et al., 2021): explicit feature crosses whose
order grows by one per layer, then an MLP.

With ``x0`` the normalised, flattened tokens, layer ``l`` computes
``x_{l+1} = x0 * (W_l x_l + b_l) + x_l`` (elementwise product), so ``L`` layers hold products
of up to ``L + 1`` inputs through their weights alone, which an MLP has to build from its
nonlinearities. ``rank > 0`` factors each ``W_l`` as
``U_l V_l`` (DCN-V2's low-rank cross) for wide inputs.

Why it is here: DCN-V2 is the cross model recommendation engineers reach for, and crosses of
order three are what the ``dot`` interaction leaves to its MLP. ``synthetic-ads``' ``cross``
kind hides its label in a three-way parity that no feature or pair reveals. Alone on that
parity (``tools/interaction_cross_probe.py``, ten uninformative tokens beside the three that
matter) this network found it after about 1,000 steps where the dot interaction and Wukong took
2,500-3,000. Inside ``tiny`` and ``tiny-gem`` it finds it only once the tokens share one scale
(``model.token_norm``; ``sample`` gave ``tiny-gem`` click NE 0.8512 at 2,000 steps against 0.9057
for the preset and an achievable 0.8439), or as ``model.cross_branch`` beside the interaction
(0.8509): the trained model's attribute-attention token is 5-6 in RMS against 0.06-1.3 for the
others, so the LayerNorm over the flattened tokens leaves the context and the candidate too small
for their product to be learnt. No preset uses it: every form cost NE on one pass of
MovieLens-100k (docs/results.md).

``multiplier = "token"`` multiplies the crosses by the tokens each over its own RMS (the layers'
input and the MLP keep the LayerNorm-ed ones).
"""

from __future__ import annotations

from torch import Tensor, nn

from gem_core.flops import linear_layer_flops
from gem_core.model.interaction import mlp_layers
from gem_core.model.token_norm import SampleTokenRMSNorm


class CrossLayer(nn.Module):
    """One cross: ``x0 * (W x + b) + x``, ``W`` full (``rank = 0``) or ``U V`` of rank ``rank``."""

    def __init__(self, width: int, rank: int) -> None:
        super().__init__()
        self.project = (nn.Linear(width, width) if rank == 0 else
                        nn.Sequential(nn.Linear(width, rank, bias=False), nn.Linear(rank, width)))

    def forward(self, x0: Tensor, x: Tensor) -> Tensor:
        return x0 * self.project(x) + x


class CrossNetworkInteraction(nn.Module):
    """``(B, n, d)`` tokens -> ``(B, out_dim)``: LayerNorm of the flattened tokens, ``layers``
    cross layers, then an MLP of widths ``hidden`` (SiLU, dropout).

    ``multiplier = "token"``: the crosses multiply by each token scaled by its own RMS
    (:class:`~gem_core.model.token_norm.SampleTokenRMSNorm`) instead of by the LayerNorm-ed
    tokens, which stay the first layer's input: the products get every token at one scale, and
    the sizes the LayerNorm keeps (how many events a sum token matched) still reach the MLP."""

    def __init__(self, num_tokens: int, dim: int, *, layers: int, rank: int,
                 hidden: tuple[int, ...], dropout: float, multiplier: str = "flat") -> None:
        super().__init__()
        width = num_tokens * dim
        self.norm = nn.LayerNorm(width)
        if multiplier not in ("flat", "token"):
            raise ValueError(f"cross multiplier {multiplier!r}: expected 'flat' or 'token'")
        self.multiplier = SampleTokenRMSNorm(num_tokens) if multiplier == "token" else None
        self.crosses = nn.ModuleList(CrossLayer(width, rank) for _ in range(layers))
        mlp, self.out_dim = mlp_layers(width, hidden, dropout)
        self.mlp = nn.Sequential(*mlp)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.norm(tokens.flatten(1))
        x0 = x if self.multiplier is None else self.multiplier(tokens).flatten(1)
        for cross in self.crosses:
            x = cross(x0, x)
        return self.mlp(x)

    def flops(self, batch: int) -> int:
        """Forward FLOPs (matmuls only): every cross projection and the MLP."""
        return linear_layer_flops(self, batch)

