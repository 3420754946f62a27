"""The gated norm around attention, and gem-core's reference norm backend.

HSTU-style attention normalises its output and multiplies it by a gate computed from the layer's
input: ``(norm(x) * weight + bias) * gate``. It is memory-bound (a read of ``x`` and ``gate``,
one write), so fast backends fuse it into one kernel (gem-kernels' ``triton``); this module is
the definition they are tested against and the ``reference`` backend the model uses otherwise.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from gem_core import contracts

NormKind = Literal["layer", "rms"]


NormBackend = contracts.NormBackend
"""The contract of kind ``norm`` (:class:`gem_core.contracts.NormBackend`)."""


def gated_norm_reference(
    x: Tensor, gate: Tensor, weight: Tensor, bias: Tensor | None = None, *,
    kind: NormKind = "layer", eps: float = 1e-5,
) -> Tensor:
    """``(norm(x) * weight + bias) * gate`` over the last dimension, in float32 (float64 for
    float64 inputs, so tests get an exact oracle), returned in ``x.dtype``."""
    if x.shape != gate.shape:
        raise ValueError(f"gated norm: x {tuple(x.shape)} and gate {tuple(gate.shape)} differ")
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


class ReferenceNorm(NormBackend):
    """The ``reference`` norm backend: :func:`gated_norm_reference`, autograd for gradients."""

    name = "reference"

    def gated_norm(self, x: Tensor, gate: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                   kind: NormKind = "layer", eps: float = 1e-5) -> Tensor:
        return gated_norm_reference(x, gate, weight, bias, kind=kind, eps=eps)
