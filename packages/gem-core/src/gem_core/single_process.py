"""The ``none`` dense strategy: one process, the model as it is, gem-core's own optimizer step."""

from __future__ import annotations

from typing import Callable

from torch import nn

from gem_core.contracts import DenseSharding
from gem_core.engine import Engine


class SingleProcess(DenseSharding):
    """The ``none`` dense strategy: one process, no wrapping."""

    def apply(self, model: nn.Module, *, ctx, make_optimizer: Callable, precision,
              options) -> Engine:
        if ctx.world_size > 1:
            raise RuntimeError(
                f"dense_sharding 'none' runs one process but this run has {ctx.world_size} ranks; "
                "choose a data-parallel strategy (e.g. --sharding ddp from gem-parallel)"
            )
        return Engine(model, make_optimizer(model))

    def plan_estimate(self, facts, options):
        """Everything on the one rank; nothing sent."""
        from gem_core.plan_estimate import Estimate, dense_memory
        if facts.world_size > 1:
            raise ValueError(f"dense_sharding 'none' runs one process; the layout has "
                             f"{facts.world_size} GPUs")
        return Estimate(memory=dense_memory(facts),
                        communication={"dense": 0})
