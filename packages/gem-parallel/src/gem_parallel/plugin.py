"""gem-parallel's plugin module, named by its ``gem`` entry point. Registration only: every
``load`` imports its implementation when a run selects it."""

from __future__ import annotations

from gem_core import hookimpl
from gem_core.registry import AutoContext, ImplementationSpec


def _ddp():
    from gem_parallel.ddp import DistributedDataParallelStrategy

    return DistributedDataParallelStrategy()


def _lpt():
    from gem_parallel.balance import lpt_balancer

    return lpt_balancer


@hookimpl
def gem_register_dense_sharding(register) -> None:
    register(ImplementationSpec(
        name="ddp", load=_ddp,
        description="torch DistributedDataParallel: replicated dense parameters, all-reduced grads",
    ))


@hookimpl
def gem_register_batch_balancers(register) -> None:
    register(ImplementationSpec(
        name="lpt", load=_lpt,
        description="longest-processing-time greedy: evens out per-rank attention cost",
    ))


@hookimpl
def gem_default_dense_sharding(context: AutoContext):
    if context.world_size > 1:
        return "ddp", f"{context.world_size} ranks: data parallel with replicated dense weights"
    return None


@hookimpl
def gem_default_balancer(context: AutoContext):
    if context.world_size > 1:
        return "lpt", "several ranks: balance attention cost so no rank straggles"
    return None
