"""``fsdp2`` and ``hsdp``: FSDP2 (``fully_shard``) over a 1-D or 2-D DeviceMesh.

Each of the model's ``parallel_units()`` (the GEM model: its sequence-tower blocks) is its own
FSDP unit (its parameters are gathered just before it runs and freed after), then the root takes
every remaining parameter (embeddings, heads). HSDP shards
within a ``dp_shard`` group and replicates across ``dp_replicate`` groups; the mesh is ordered
``("dp_replicate", "dp_shard")`` as FSDP2 expects.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import attrs
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from gem_core.contracts import DenseSharding, require_strategy_model
from gem_core.distributed import ParallelContext
from gem_core.engine import Engine, clipped_parameters, scale_to_max_norm
from gem_core.errors import GemConfigError
from gem_core.plan_estimate import Estimate, PlanFacts, dense_memory, ring_fraction
from gem_parallel.eval_replica import EvalReplica

log = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class FsdpOptions:
    """``[parallel.dense]`` of ``fsdp2``."""

    reshard_after_forward: bool = True
    """Free gathered block parameters after the forward (ZeRO-3 like) and gather them again for
    the backward; False keeps them until the backward (ZeRO-2 like: more memory, less traffic)."""


@attrs.frozen(kw_only=True)
class HsdpOptions:
    """``[parallel.dense]`` of ``hsdp``: the 2-D mesh. ``dp_replicate x dp_shard`` must equal the
    number of ranks."""

    dp_shard: int = 0
    """Ranks that shard one copy of the parameters (usually the GPUs of a node); 0: the ranks of
    a node when the run has several nodes (all-gathers stay inside a node, one copy per node),
    every rank on one node."""

    dp_replicate: int = 0
    """Copies of the sharded parameters, all-reduced across; 0: the number of ranks over
    ``dp_shard``."""

    reshard_after_forward: bool = True
    """As for ``fsdp2``."""


def _require_process_group(name: str, ctx: ParallelContext) -> None:
    if not ctx.is_distributed:
        raise RuntimeError(
            f"dense_sharding {name!r} shards parameters across ranks but this run has one process; "
            f"launch several (gem train --nproc-per-node N) or use --sharding none"
        )


def hsdp_mesh_shape(options: HsdpOptions, ctx: ParallelContext) -> tuple[int, int]:
    """``(dp_replicate, dp_shard)`` from the options, checked against the number of ranks;
    without them, shard within a node and replicate across the nodes of the launch (on one
    node: shard over every rank). Ranks are numbered node by node, so the mesh's ``dp_shard``
    rows are the nodes."""
    world_size = ctx.world_size
    shard, replicate = options.dp_shard, options.dp_replicate
    if not shard:
        shard = max(world_size // replicate, 1) if replicate else ctx.local_world_size
    replicate = replicate or max(world_size // shard, 1)
    if replicate * shard != world_size:
        raise GemConfigError(
            f"parallel.dense: dp_replicate ({replicate}) x dp_shard ({shard}) must equal the "
            f"number of ranks ({world_size})"
        )
    return replicate, shard


class FullyShardedStrategy(DenseSharding):
    """``fsdp2`` (``hybrid=False``) or ``hsdp`` (``hybrid=True``)."""

    def __init__(self, *, hybrid: bool) -> None:
        self.hybrid = hybrid
        self.name = "hsdp" if hybrid else "fsdp2"

    def mesh(self, ctx: ParallelContext, options: FsdpOptions | HsdpOptions
             ) -> tuple[DeviceMesh, bool]:
        if self.hybrid:
            shape = hsdp_mesh_shape(options, ctx)
            names = ("dp_replicate", "dp_shard")
            if ctx.is_main:
                log.info("hsdp mesh: %d replica(s) (dp_replicate) x %d shard(s) (dp_shard) over "
                         "%d node(s) of %d rank(s)", *shape, ctx.num_nodes, ctx.local_world_size)
        else:
            shape, names = (ctx.world_size,), ("dp_shard",)
        return init_device_mesh(ctx.device.type, shape, mesh_dim_names=names), \
            options.reshard_after_forward

    def apply(self, model: nn.Module, *, ctx: ParallelContext, make_optimizer: Callable,
              precision, options: FsdpOptions | HsdpOptions) -> Engine:
        _require_process_group(self.name, ctx)
        units = require_strategy_model(model, f"dense_sharding {self.name!r}",
                                       "parallel_units").parallel_units()
        mesh, reshard = self.mesh(ctx, options)
        replica = EvalReplica(model)
        # The recipe's policy (e.g. bf16 parameters, fp32 reductions); None: keep fp32 throughout.
        policy = precision.mixed_precision_policy() or MixedPrecisionPolicy()
        for block in units:
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        # The root keeps its parameters gathered after the forward: the backward needs them first.
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
        return FsdpEngine(model, make_optimizer(model), replica=replica)

    def plan_estimate(self, facts: PlanFacts, options: FsdpOptions | HsdpOptions) -> Estimate:
        """Parameters, gradients and moments divided over a shard group (every rank for
        ``fsdp2``); parameters all-gathered in the forward and again in the backward, gradients
        reduce-scattered within the group, and under HSDP all-reduced across the groups."""
        n, dense = facts.world_size, facts.dense_parameters
        size = dense * 4
        if not self.hybrid:
            return Estimate(memory=dense_memory(facts, params_over=n, grads_over=n,
                                                optimizer_over=n),
                            communication={"dense": 3 * ring_fraction(n) * size if n > 1 else 0})
        opts = options
        shard = opts.dp_shard or (n // opts.dp_replicate if opts.dp_replicate else n)
        if not shard or n % shard or (opts.dp_replicate and opts.dp_replicate * shard != n):
            raise ValueError(f"hsdp: dp_shard {shard} x dp_replicate {opts.dp_replicate or '?'} "
                             f"does not make {n} GPUs")
        replicas = n // shard
        inner = 3 * (shard - 1) / shard * size
        outer = 2 * (replicas - 1) / replicas * size / shard if replicas > 1 else 0
        return Estimate(memory=dense_memory(facts, params_over=shard, grads_over=shard,
                                            optimizer_over=shard),
                        communication={"dense": inner + outer if n > 1 else 0})


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class FsdpEngine(Engine):
    """An engine over an FSDP2 root: DTensor gradients, full state dicts through
    ``torch.distributed.checkpoint.state_dict``, evaluation on a gathered replica."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 replica: EvalReplica) -> None:
        super().__init__(model, optimizer)
        self.replica = replica

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)
        if mode:
            self.replica.release()
        else:
            # Every rank enters evaluation together: the one moment a gather is safe.
            self.replica.fill(lambda: get_model_state_dict(
                self.model, options=StateDictOptions(full_state_dict=True)))

    def predict(self, batch: Any) -> Any:
        return self.replica(batch)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        params = clipped_parameters(self.model, self.optimizer)
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if isinstance(norm, DTensor):
            # A partial (per-shard) norm: reduce it over the mesh to the global one.
            norm = norm.full_tensor()
        # One gradient at a time: the fused foreach path mis-scales DTensor gradients by a
        # plain-tensor norm.
        scale_to_max_norm(params, max_norm, norm)
        return norm

    def state_dict(self) -> dict[str, Any]:
        return {"model": get_model_state_dict(self.model, options=_FULL),
                "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=_FULL)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.model, state["model"], options=options)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=options)
