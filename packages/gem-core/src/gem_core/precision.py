"""The precision-recipe contract, and the ``fp32`` reference recipe."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Mapping

from torch import nn

from gem_core import contracts
from gem_core.errors import GemConfigError

PrecisionRecipe = contracts.PrecisionRecipe
"""The contract of kind ``precision`` (:class:`gem_core.contracts.PrecisionRecipe`)."""


def reject_options(owner: str, options: Mapping[str, Any]) -> None:
    """For implementations that take no options: any option is a mistake worth an error."""
    if options:
        raise GemConfigError(f"{owner} takes no options; got {', '.join(sorted(options))}")


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
