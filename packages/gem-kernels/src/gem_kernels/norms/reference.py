"""The gated norm in plain PyTorch: the definition the Triton kernels are tested against."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

NormKind = Literal["layer", "rms"]


def gated_norm_reference(
    x: Tensor, gate: Tensor, weight: Tensor, bias: Tensor | None = None, *,
    kind: NormKind = "layer", eps: float = 1e-5,
) -> Tensor:
    """``(norm(x) * weight + bias) * gate`` over the last dimension, in float32 (float64 for
    float64 inputs, so tests get an exact oracle)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(compute)
    if kind == "layer":
        y = F.layer_norm(xf, xf.shape[-1:], eps=eps)
    elif kind == "rms":
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    else:
        raise ValueError(f"unknown norm kind {kind!r}; use 'layer' or 'rms'")
    y = y * weight.to(compute)
    if bias is not None:
        y = y + bias.to(compute)
    return (y * gate.to(compute)).to(x.dtype)
