"""The precision-recipe contract, and the ``fp32`` reference recipe."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

from torch import nn

from gem_core import contracts

PrecisionRecipe = contracts.PrecisionRecipe
"""The contract of kind ``precision`` (:class:`gem_core.contracts.PrecisionRecipe`)."""


class Float32Recipe(PrecisionRecipe):
    """``fp32``: everything in float32."""

    name = "fp32"
    compute_dtype = "float32"

    def convert(self, model: nn.Module, ctx: Any, options: None) -> nn.Module:
        return model  # it declares no options: core refused any

    def autocast(self, device_type: str) -> ContextManager[None]:
        return contextlib.nullcontext()

    def mixed_precision_policy(self) -> None:
        return None
