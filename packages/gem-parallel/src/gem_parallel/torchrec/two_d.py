"""The 2D sparse layout of the ``torchrec`` embedding sharding (``[parallel.embedding] layout =
"2d"``): TorchRec's ``DMPCollection`` layout, built from TorchRec's own pieces.

The N ranks form N / G *sharding groups* of G ranks (``sharding_group_size``). Within a group the
tables are model parallel exactly as with ``layout = "model_parallel"`` over G ranks (one plan,
TorchRec's planner on a G-rank topology; the lookups' all-to-alls stay inside the group); every
group holds the same shards, so each shard has N / G *replicas*, one per group, and the replicas
are averaged (weights and, by default, the fused optimizer's state) every ``sync_every`` steps.
Memory per rank is that of G ranks, not N; the lookups' all-to-all spans G ranks; the price is
the replicas' all-reduce.

Groups are strided as TorchRec's default (``use_inter_host_allreduce=False``): group ``g`` holds
ranks ``g, g + N/G, g + 2N/G, ...``, so the replicas of a shard are neighbouring ranks (the same
node when a node's ranks are a multiple of N / G) and the replicas' all-reduce stays inside a
node, while the lookups cross nodes.

What TorchRec does and this module does alike (``torchrec.distributed.model_parallel``):

- process groups: a ``DeviceMesh`` of shape ``(N/G, G)`` named ``("replicate", "shard")``
  (``DMPCollection._create_process_groups``);
- one plan for G ranks, made on rank 0 and broadcast, then remapped to this rank's group
  (``DMPCollection._remap_sharding_plan``: plan rank ``r`` becomes ``r * N/G + group``);
- modules sharded with ``ShardingEnv2D`` (the all-to-alls use the sharding group's process
  group; the gradient division of TorchRec's all-to-all backward is by G);
- the sync: ``allreduce_coalesced`` of every local shard's weights and optimizer state over the
  replica group, averaged (``DMPCollection.sync()``); the train pipeline's default interval is one
  step.

Why not ``DMPCollection`` itself: in TorchRec 1.8 its constructor asserts a CUDA (or MTIA) device
and it wraps the whole model (``DistributedModelParallel``), while this strategy keeps the sharded
modules outside the model's module tree (see :mod:`gem_parallel.torchrec.sharding`). The pieces
above run on CPU over gloo with two differences, both small: gloo has no ``ReduceOp.AVG``, so the
sync sums and divides by N / G (the same average); and the state dict is asked for as
``ShardedTensor``s over the sharding group (``ShardingEnv2D`` defaults to DTensors), the form this
strategy's checkpoints use, so a 2D checkpoint reshards onto any layout and number of ranks (DCP
writes each shard once: the replicas' copies have the same offsets and are deduplicated).

The gradient the tables see: within a group TorchRec's backward divides by G, so a group's fused
update uses ``N / G`` times its ranks' share of the global-mean gradient; averaging the N / G
replicas gives the global-mean gradient's update: with SGD and ``sync_every = 1`` exactly the
update of one process on the whole batch (tested). Row-wise Adagrad's per-row sums are then the
average of the groups' sums of squares, not the sum of squares of the average: close, not equal
(TorchRec's semantics).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import attrs
import torch
import torch.distributed as dist

from gem_core.errors import GemConfigError
from gem_core.plan_estimate import Estimate, ring_fraction
from gem_parallel.torchrec.plan import SHARDING_TYPES, TorchRecOptions
from gem_parallel.torchrec.state import optimizer_states, table_weights

log = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class SparseLayout:
    """Where a run's tables go under ``layout = "2d"``."""

    world_size: int = attrs.field(validator=attrs.validators.ge(1))
    """Every rank of the run (N)."""

    group_size: int = attrs.field(validator=attrs.validators.ge(1))
    """Ranks per sharding group (G): the tables are model parallel over them."""

    sync_every: int = 1
    """Steps between two averages of the replicas."""

    sync_optimizer_state: bool = True
    """Whether the fused optimizer's state is averaged with the weights."""

    @property
    def groups(self) -> int:
        """Sharding groups (N / G): the replicas of every shard."""
        return self.world_size // self.group_size

    def group_ranks(self) -> list[list[int]]:
        """The ranks of each sharding group, strided as TorchRec's default."""
        return [[self.groups * position + group for position in range(self.group_size)]
                for group in range(self.groups)]

    def global_rank(self, plan_rank: int, rank: int) -> int:
        """The global rank that holds, in ``rank``'s group, what the G-rank plan gave
        ``plan_rank``."""
        return plan_rank * self.groups + rank % self.groups

    def describe(self) -> dict[str, Any]:
        """Plain data for ``summary.json`` and the plan."""
        return {"layout": "2d", "sharding_group_size": self.group_size,
                "sharding_groups": self.groups, "group_ranks": self.group_ranks(),
                "sync_every": self.sync_every,
                "sync_optimizer_state": self.sync_optimizer_state}


def resolve(options: TorchRecOptions, world_size: int) -> SparseLayout | None:
    """The 2D layout of ``options`` on ``world_size`` ranks; None for ``model_parallel``.
    Options that make no sense here are refused with the reason."""
    size = options.sharding_group_size
    if options.layout != "2d":
        if size is not None:
            raise GemConfigError(
                f"parallel.embedding.sharding_group_size = {size} applies to layout '2d'; this "
                f"run's parallel.embedding.layout is {options.layout!r} (every table sharded "
                "over all ranks): set parallel.embedding.layout=2d or drop the group size")
        return None
    if size is None:
        raise GemConfigError(
            "parallel.embedding.layout '2d' needs parallel.embedding.sharding_group_size: the "
            f"ranks that shard the tables together (a divisor of this run's {world_size} "
            "rank(s); each group holds every table once)")
    if world_size % size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise GemConfigError(
            f"parallel.embedding.sharding_group_size {size} does not divide this run's "
            f"{world_size} rank(s) into whole sharding groups; choose one of "
            f"{', '.join(map(str, divisors))}"
            + (" (1 on one process: every table whole on the one rank)" if world_size == 1
               else ""))
    multi_node = sorted({kind for kind in options.plan.values() if kind not in SHARDING_TYPES})
    if multi_node:
        raise GemConfigError(
            f"parallel.embedding.plan names {multi_node[0]!r}, which layout '2d' does not "
            f"offer: a sharding group is planned as one node of {size} ranks; use "
            f"{', '.join(SHARDING_TYPES)}")
    return SparseLayout(world_size=world_size, group_size=size, sync_every=options.sync_every,
                        sync_optimizer_state=options.sync_optimizer_state)


class TwoDimGroups:
    """The process groups of a 2D layout, for this rank (collective to build: every rank
    builds it together)."""

    def __init__(self, layout: SparseLayout, device: torch.device) -> None:
        from torch.distributed.device_mesh import DeviceMesh

        self.layout = layout
        self.device = device
        self.rank = dist.get_rank()
        self.mesh = DeviceMesh(device_type=device.type, mesh=layout.group_ranks(),
                               mesh_dim_names=("replicate", "shard"))
        self.sharding_pg = self.mesh.get_group(mesh_dim="shard")
        """This rank's sharding group: the lookups' all-to-alls."""
        self.replica_pg = self.mesh.get_group(mesh_dim="replicate")
        """The ranks holding the same shards as this one: the sync's all-reduce."""

    def plan(self, module: torch.nn.Module, sharders: Sequence[Any],
             constraints: Mapping[str, Any]) -> tuple[Any, Any]:
        """``(plan, env)``: TorchRec's plan for one group of G ranks (rank 0 plans, every rank
        receives it), remapped to this rank's group, and the ``ShardingEnv2D`` to shard with."""
        from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
        from torchrec.distributed.types import ShardingEnv2D

        size = self.layout.group_size
        topology = Topology(world_size=size, compute_device=self.device.type,
                            local_world_size=size)
        planner = EmbeddingShardingPlanner(topology=topology, constraints=dict(constraints))
        plan = planner.collective_plan(module, list(sharders), dist.group.WORLD)
        self._remap(plan)
        env = ShardingEnv2D(sharding_pg=self.sharding_pg, replica_pg=self.replica_pg,
                            global_pg=dist.group.WORLD, device_mesh=self.mesh,
                            node_group_size=size)
        # ShardedTensors (over the sharding group) in the state dict, as the other layouts
        # checkpoint; ShardingEnv2D asks for DTensors by default.
        env.output_dtensor = False
        return plan, env

    def _remap(self, plan: Any) -> None:
        """Plan ranks to this group's global ranks, in place (as
        ``DMPCollection._remap_sharding_plan`` does)."""
        from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
        from torch.distributed.remote_device import _remote_device
        from torchrec.distributed.comm import get_local_size

        def where(plan_rank: int) -> _remote_device:
            rank = self.layout.global_rank(plan_rank, self.rank)
            device = "cpu" if self.device.type == "cpu" else \
                f"{self.device.type}:{rank % get_local_size()}"
            return _remote_device(f"rank:{rank}/{device}")

        for module_plan in plan.plan.values():
            for sharding in module_plan.values():
                sharding.ranks = [self.layout.global_rank(r, self.rank)
                                  for r in sharding.ranks or []]
                spec = sharding.sharding_spec
                if isinstance(spec, EnumerableShardingSpec):
                    for shard in spec.shards:
                        shard.placement = where(shard.placement.rank())


@attrs.define(kw_only=True)
class SyncSchedule:
    """When the replicas are averaged: after every ``every``-th training step, at the start of
    the next one (before its lookups), and before the tables are read whole (checkpoints,
    evaluation) if a step ran since the last average."""

    every: int = attrs.field(validator=attrs.validators.ge(1))
    """Steps between two averages."""

    steps_since_sync: int = 0
    """Training steps started since the replicas were last equal."""

    def step_starts(self) -> bool:
        """Count a training step that starts now; True when the replicas must be averaged
        before it (``every`` steps ran since the last average)."""
        due = self.steps_since_sync >= self.every
        self.steps_since_sync = 1 if due else self.steps_since_sync + 1
        return due

    @property
    def pending(self) -> bool:
        """Whether a step ran since the replicas were last equal."""
        return self.steps_since_sync > 0

    def synced(self) -> None:
        self.steps_since_sync = 0


class ReplicaSync:
    """Averages this rank's shards with their replicas in the other groups (collective over
    the replica group: every rank calls it at the same points), when :class:`SyncSchedule`
    says: the collection calls :meth:`before_training_step` at the start of every training
    forward (one per step) and :meth:`sync_pending` before the tables are read whole."""

    def __init__(self, sharded: Any, groups: TwoDimGroups) -> None:
        self.layout = groups.layout
        self._pg = groups.replica_pg
        weights = table_weights(sharded)
        # Views of FBGEMM TBE's weights and optimizer state: averaged in place.
        self.weights = [shard.tensor for weight in weights.values()
                        for shard in weight.local_shards()]
        self.states = [shard.tensor for states in optimizer_states(sharded).values()
                       for state in states.values() for shard in state.local_shards()]
        self.schedule = SyncSchedule(every=self.layout.sync_every)
        self.syncs = 0

    @property
    def tensors(self) -> list[torch.Tensor]:
        """What one sync averages."""
        return self.weights + (self.states if self.layout.sync_optimizer_state else [])

    @property
    def bytes_per_sync(self) -> int:
        """Bytes of this rank's tensors that one sync all-reduces."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def before_training_step(self) -> None:
        if self.schedule.step_starts():
            self._average()

    def sync_pending(self) -> None:
        """Average the replicas if a step ran since the last average."""
        if self.schedule.pending:
            self.sync()

    def mark_synced(self) -> None:
        """The replicas were made equal otherwise (loaded from one checkpoint)."""
        self.schedule.synced()

    def sync(self) -> None:
        """Average the replicas now."""
        self._average()
        self.schedule.synced()

    @torch.no_grad()
    def _average(self) -> None:
        replicas = self.layout.groups
        if replicas > 1:
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for tensor in self.tensors:
                by_dtype.setdefault(tensor.dtype, []).append(tensor)
            for tensors in by_dtype.values():
                # gloo has no ReduceOp.AVG (DMPCollection's): sum, then divide.
                self._pg.allreduce_coalesced(tensors, dist.AllreduceCoalescedOptions()).wait()
                for tensor in tensors:
                    tensor.div_(replicas)
        self.syncs += 1


def local_shard_bytes(sharded: Any) -> dict[str, int]:
    """Bytes of this rank's shards: table weights and fused-optimizer state (measured)."""
    weights = sum(shard.tensor.numel() * shard.tensor.element_size()
                  for weight in table_weights(sharded).values()
                  for shard in weight.local_shards())
    states = sum(shard.tensor.numel() * shard.tensor.element_size()
                 for values in optimizer_states(sharded).values()
                 for state in values.values() for shard in state.local_shards())
    return {"embedding_params": weights, "embedding_optimizer": states}


def gather_shard_bytes(sharded: Any, world_size: int) -> list[dict[str, int]]:
    """:func:`local_shard_bytes` of every rank, in rank order (collective)."""
    mine = local_shard_bytes(sharded)
    if world_size == 1:
        return [mine]
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine)
    return everyone


def run_report(layout: SparseLayout, replicas: ReplicaSync | None) -> dict[str, Any]:
    """``summary.json``'s ``embedding_sharding.sparse_layout``: the layout, and what this rank
    averaged (bytes per sync, syncs so far; none with one group)."""
    return {**layout.describe(),
            "sync_bytes_per_rank": replicas.bytes_per_sync if replicas is not None else 0,
            "syncs": replicas.syncs if replicas is not None else 0}


def with_replica_sync(estimate: Estimate, layout: SparseLayout) -> Estimate:
    """A 2D layout's estimate: the model-parallel estimate over one group of G ranks (what the
    caller computed) plus the replicas' average, a ring all-reduce over the N / G groups of the
    rank's shard bytes (weights, and optimizer state when synced) every ``sync_every`` steps."""
    synced = estimate.memory["embedding_params"].bytes
    if layout.sync_optimizer_state:
        synced += estimate.memory["embedding_optimizer"].bytes
    per_step = 2 * ring_fraction(layout.groups) * synced / layout.sync_every
    return attrs.evolve(
        estimate,
        communication={**estimate.communication, "embedding_sync": per_step},
        details={**estimate.details, "sparse_layout": {
            **{k: v for k, v in layout.describe().items() if k != "group_ranks"},
            "sync_bytes_per_rank": synced}})
