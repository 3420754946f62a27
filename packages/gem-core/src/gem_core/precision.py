"""The precision-recipe contract, and the ``fp32`` reference recipe."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Mapping

from torch import nn

from gem_core import contracts
from gem_core.config.validators import reject_options

PrecisionRecipe = contracts.PrecisionRecipe
"""The contract of kind ``precision`` (:class:`gem_core.contracts.PrecisionRecipe`)."""


class Float32Recipe(PrecisionRecipe):
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
