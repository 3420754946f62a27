"""How a rank's jagged features reach TorchRec's sharded modules: as one ``KeyedJaggedTensor``
(padded with empty requests where gloo needs every rank's batch the same size), and the gradient
scaling applied to the lookups."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from gem_core.jagged import Jagged


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


def scale_grad(x: Tensor, scale: float) -> Tensor:
    """``x`` unchanged; its gradient multiplied by ``scale`` (nothing added when it is 1)."""
    return x if scale == 1.0 else _ScaleGrad.apply(x, scale)


def keyed_jagged(features: Mapping[str, Jagged], keys: Sequence[str], pad_rows: int = 0) -> Any:
    """The features as one ``KeyedJaggedTensor``; ``pad_rows`` empty requests appended."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    def lengths(key: str) -> Tensor:
        own = features[key].lengths().to(torch.int64)
        return torch.cat([own, own.new_zeros(pad_rows)]) if pad_rows else own

    return KeyedJaggedTensor.from_lengths_sync(
        keys=list(keys),
        values=torch.cat([features[k].values.to(torch.int64) for k in keys]),
        lengths=torch.cat([lengths(k) for k in keys]),
    )
