"""Activation-checkpointing policy ``budget``: the compiler chooses what to recompute (GEM's
AutoAC).

``full`` and ``selective`` fix by hand which parts run again in the backward. Under
``train.compile`` AOTAutograd's partitioner can choose instead: with
``torch._functorch.config.activation_memory_budget`` below 1 it solves a knapsack over the
operators of each compiled block, keeping the activations that are expensive to recompute (matmul
outputs) and recomputing the cheap ones (norms, activations, masks, casts), until what the forward
saves is at most ``memory_budget`` of what the default, runtime-first partition saves (0: as if the
whole compiled block were checkpointed). The policy wraps nothing itself; it hands that setting to
the compiled step (:meth:`compiler_settings`), so it needs ``train.compile`` and is refused
without it. ``gem bench memory`` measures what each budget keeps and costs.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs
from torch import nn

from gem_core.config.validators import Rule
from gem_core.contracts import ActivationCheckpointing
from gem_core.distributed import ParallelContext


@attrs.frozen
class _BudgetRange(Rule):
    def __call__(self, instance: Any, attribute: attrs.Attribute, value: float) -> None:
        if not 0 < value <= 1:
            raise ValueError(f"{attribute.name} must be in (0, 1] (the fraction of the default "
                             f"partition's saved activations to keep); got {value!r}")

    @property
    def rule(self) -> str:
        return "in (0, 1]"


@attrs.frozen(kw_only=True)
class BudgetOptions:
    """``[parallel.activation_checkpointing]`` of ``budget``."""

    memory_budget: float = attrs.field(default=0.5, converter=float, validator=_BudgetRange())
    """Fraction, in (0, 1], of the activations the compiled forward saves by default that it
    may keep; the compiler recomputes the cheapest rest in the backward. 1: no recomputation
    beyond the default partition's."""


class BudgetCheckpointing(ActivationCheckpointing):
    """``budget``: an activation memory budget for the compiled step (options:
    ``memory_budget``)."""

    def apply(self, model: nn.Module, *, ctx: ParallelContext,
              options: BudgetOptions) -> nn.Module:
        return model  # the compiler does the rest

    def compiler_settings(self, options: BudgetOptions) -> Mapping[str, Any]:
        return {"activation_memory_budget": options.memory_budget}
