"""The precision-recipe contract, and the ``fp32`` reference recipe."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Protocol

from torch import nn


class PrecisionRecipe(Protocol):
    """How a run computes. Master weights, loss and metrics stay in float32 in every recipe."""

    name: str
    compute_dtype: str
    """The dtype matmuls run in (``float32``, ``bfloat16``, ``float8``...)."""

    def convert(self, model: nn.Module, ctx: Any) -> nn.Module:
        """Swap modules (e.g. FP8 linears); runs first in ``parallelize()``."""
        ...

    def autocast(self, device_type: str) -> ContextManager[None]:
        """Context around forward and loss."""
        ...

    def mixed_precision_policy(self) -> Any:
        """For sharding strategies that cast parameters themselves (FSDP2); None for none."""
        ...


class Float32Recipe:
    """``fp32``: everything in float32."""

    name = "fp32"
    compute_dtype = "float32"

    def convert(self, model: nn.Module, ctx: Any) -> nn.Module:
        return model

    def autocast(self, device_type: str) -> ContextManager[None]:
        return contextlib.nullcontext()

    def mixed_precision_policy(self) -> None:
        return None
