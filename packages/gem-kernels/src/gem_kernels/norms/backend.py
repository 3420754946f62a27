"""The ``triton`` norm backend: the fused gated-norm kernels behind the ``norm`` hook."""

from __future__ import annotations

from torch import Tensor

from gem_core.contracts import NormBackend
from gem_core.norm import NormKind


class TritonNorm(NormBackend):
    """``gated_norm`` through :func:`gem_kernels.norms.triton_op.gated_norm` (one fused kernel
    forward, one backward; interpreted on CPU under ``TRITON_INTERPRET=1``)."""

    name = "triton"

    def gated_norm(self, x: Tensor, gate: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                   kind: NormKind = "layer", eps: float = 1e-5) -> Tensor:
        from gem_kernels.norms.triton_op import gated_norm

        return gated_norm(x, gate, weight, bias, kind=kind, eps=eps)
