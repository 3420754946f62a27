"""The request's dense features as the interaction's tokens: one token of all of them, or a
token of each.

``one`` (DLRM's way without its bottom MLP): ``W x + b``, a single ``(R, d)`` token in which
every feature is a direction. ``per_feature`` (AutoInt's and FT-Transformer's numerical
embeddings): feature ``i`` becomes its own token ``x_i w_i + b_i``, so the interaction can
cross one dense feature with a sparse one without first separating it from the others.

Why it is an option: ``synthetic-ads``' ``cross`` kind hides a three-way parity in the sign of
``dense[2]``, a request context and a candidate category. ``tools/interaction_cross_probe.py``
measures how soon an interaction alone finds it with the dense features laid out either way:
a token each found it 250-500 steps sooner on three seeds; inside ``tiny`` neither layout
found it at 2,000 steps without ``model.token_norm`` (docs/results.md).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class PerFeatureDenseTokens(nn.Module):
    """``(R, F)`` dense features -> ``(R, F, d)``: token ``i`` is ``x_i * weight_i + bias_i``."""

    def __init__(self, num_features: int, dim: int) -> None:
        super().__init__()
        # Unit-variance features give tokens of RMS about 1/sqrt(d) per entry, as the one
        # token's; the bias starts at zero so that a feature at 0 starts as no token at all.
        self.weight = nn.Parameter(torch.randn(num_features, dim) / dim ** 0.5)
        self.bias = nn.Parameter(torch.zeros(num_features, dim))

    def forward(self, dense: Tensor) -> Tensor:
        return dense.unsqueeze(-1) * self.weight + self.bias
