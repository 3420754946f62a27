"""``bf16``: bfloat16 compute with float32 master weights, reductions, loss and metrics."""

from __future__ import annotations

from typing import Any, ContextManager

import torch
from torch import nn

from gem_core.contracts import PrecisionRecipe


class BFloat16Recipe(PrecisionRecipe):
    name = "bf16"
    compute_dtype = "bfloat16"

    def convert(self, model: nn.Module, ctx: Any, options: None) -> nn.Module:
        return model  # parameters stay float32 (master weights); autocast casts per op

    def autocast(self, device_type: str) -> ContextManager[None]:
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16)

    def mixed_precision_policy(self) -> Any:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
