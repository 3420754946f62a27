"""The precision-recipe contract, and the ``fp32`` reference recipe."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Mapping, Protocol

from gem_core.errors import GemConfigError

from torch import nn


class PrecisionRecipe(Protocol):
    """How a run computes. Master weights, loss and metrics stay in float32 in every recipe."""

    name: str
    compute_dtype: str
    """The dtype matmuls run in (``float32``, ``bfloat16``, ``float8``...)."""

    def convert(self, model: nn.Module, ctx: Any, options: Mapping[str, Any]) -> nn.Module:
        """Swap modules (e.g. FP8 linears); runs first in ``parallelize()``. ``options`` is
        ``[precision.options]`` of the config; the recipe validates it (unknown keys are an
        error)."""
        ...

    def autocast(self, device_type: str) -> ContextManager[None]:
        """Context around forward and loss."""
        ...

    def mixed_precision_policy(self) -> Any:
        """For sharding strategies that cast parameters themselves (FSDP2); None for none."""
        ...


def reject_options(owner: str, options: Mapping[str, Any]) -> None:
    """For implementations that take no options: any option is a mistake worth an error."""
    if options:
        raise GemConfigError(f"{owner} takes no options; got {', '.join(sorted(options))}")


class Float32Recipe:
    """``fp32``: everything in float32."""

    name = "fp32"
    compute_dtype = "float32"

    def convert(self, model: nn.Module, ctx: Any, options: Mapping[str, Any]) -> nn.Module:
        reject_options(self.name, options)
        return model

    def autocast(self, device_type: str) -> ContextManager[None]:
        return contextlib.nullcontext()

    def mixed_precision_policy(self) -> None:
        return None
