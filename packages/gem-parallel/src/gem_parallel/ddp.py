"""``ddp``: torch DistributedDataParallel over the process group torchrun started."""

from __future__ import annotations

from typing import Callable

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gem_core.contracts import DenseSharding
from gem_core.distributed import ParallelContext
from gem_core.engine import Engine
from gem_core.plan_estimate import Estimate, PlanFacts, dense_memory, ring_fraction


class DistributedDataParallelStrategy(DenseSharding):
    def apply(self, model: nn.Module, *, ctx: ParallelContext, make_optimizer: Callable,
              precision, options) -> Engine:
        if not ctx.is_distributed:
            # One rank: DDP would only add a no-op all-reduce; keep the exact single-process math.
            return Engine(model, make_optimizer(model))
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        # The model's buffers are constants (model.token_norm, which keeps running statistics,
        # is refused on more than one rank): broadcasting them at every forward would only add
        # a collective.
        wrapped = DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False)
        return _DdpEngine(wrapped, make_optimizer(wrapped), unwrapped=model)

    def plan_estimate(self, facts: PlanFacts, options) -> Estimate:
        """Every rank holds every dense parameter, gradient and moment; the gradients are
        all-reduced."""
        n, size = facts.world_size, facts.dense_parameters * 4
        return Estimate(memory=dense_memory(facts),
                        communication={"dense": 2 * ring_fraction(n) * size if n > 1 else 0})


class _DdpEngine(Engine):
    def predict(self, batch):
        # Evaluation shards batches unevenly across ranks; the replica alone runs no collective.
        return self.unwrapped(batch)
