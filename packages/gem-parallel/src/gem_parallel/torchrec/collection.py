"""``model.embeddings`` under the ``torchrec`` embedding sharding: the reference's tables as
TorchRec modules sharded across ranks, with the reference's forward.

:mod:`gem_parallel.torchrec.sharding` says what the strategy does to the tables and why; this
module is the collection it puts in their place: how it is sharded from the reference
(:meth:`ShardedEmbeddingCollection.shard`), how it looks up (the sharded modules in training,
gathered full tables in evaluation), and what it hands the checkpointer
(:mod:`gem_core.checkpoint.sharded_modules`, named as :mod:`gem_parallel.torchrec.state` says).
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from gem_core.contracts import LearningRateFollower, ShardedModule
from gem_core.distributed import ParallelContext
from gem_core.embedding import EmbeddingTableConfig, check_ids
from gem_core.jagged import Jagged
from gem_parallel.torchrec import state
from gem_parallel.torchrec.inputs import keyed_jagged, scale_grad
from gem_parallel.torchrec.managed import ManagedEmbeddingCollection, remap_features
from gem_parallel.torchrec.plan import TorchRecOptions, describe_plan, fused_optimizer
from gem_parallel.torchrec.plan import sharders as torchrec_sharders
from gem_parallel.torchrec.two_d import ReplicaSync, TwoDimGroups


class _TorchRecTables(nn.Module):
    """The unsharded TorchRec modules (before ``shard_modules`` swaps them for sharded ones)."""

    def __init__(self, tables: Sequence[EmbeddingTableConfig], device: torch.device) -> None:
        super().__init__()
        from torchrec import (
            EmbeddingBagCollection,
            EmbeddingBagConfig,
            EmbeddingCollection,
            EmbeddingConfig,
            PoolingType,
        )

        pooled = [t for t in tables if t.pooling != "none"]
        sequence = [t for t in tables if t.pooling == "none"]
        pooling = {"sum": PoolingType.SUM, "mean": PoolingType.MEAN}
        self.pooled_keys = [f for t in pooled for f in t.features]
        self.sequence_keys = [f for t in sequence for f in t.features]
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.num_embeddings,
                               feature_names=list(t.features), pooling=pooling[t.pooling])
            for t in pooled], device=device) if pooled else None
        self.ec = EmbeddingCollection(tables=[
            EmbeddingConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.num_embeddings,
                            feature_names=list(t.features))
            for t in sequence], device=device) if sequence else None


def _lookup(weight: Tensor, config: EmbeddingTableConfig, jagged: Jagged) -> Tensor:
    if config.pooling == "none":
        return F.embedding(jagged.values, weight)
    return F.embedding_bag(jagged.values, weight, jagged.offsets[:-1], mode=config.pooling)


class ShardedEmbeddingCollection(nn.Module, ShardedModule, LearningRateFollower):
    """``model.embeddings`` after the ``torchrec`` strategy: same forward as the reference.

    The TorchRec modules live outside the module tree (see
    :mod:`gem_parallel.torchrec.sharding`); ``plan`` describes where every table went. A copy
    (``deepcopy``: FSDP2's evaluation replica) is *local*: it owns no shards and looks up the
    tables its source gathered for evaluation.
    """

    def __init__(self, tables: Sequence[EmbeddingTableConfig], *, local: bool = False) -> None:
        super().__init__()
        self.table_configs = {t.name: t for t in tables}
        self.plan: dict[str, dict[str, Any]] = {}
        self._local = local
        self._source: Callable[[], ShardedEmbeddingCollection | None] | None = None
        """Local copies: weak reference to the collection they were copied from."""
        self._full: dict[str, Tensor] | None = None
        self._optimizer = ""
        """The fused sparse optimizer's name (recorded with checkpoints)."""
        self._lr, self._lr_schedule = 0.0, "constant"
        self.__dict__["_sharded"] = None  # not a child module, on purpose
        self._root: Callable[[], nn.Module | None] | None = None
        """Weak reference to the model holding this collection (for the dense dtype)."""
        self._world_size, self._rank, self._device = 1, 0, torch.device("cpu")
        self._equal_pooled_batches = False
        """Pad the pooled lookups to the largest batch of any rank (see :meth:`_pad_rows`)."""
        self._group: Any = None
        """The process group the tables are sharded over (None: every rank; layout "2d": this
        rank's sharding group), of ``_group_size`` ranks."""
        self._group_size = 1
        self._replicas: ReplicaSync | None = None
        """Layout "2d": averages this rank's shards with their replicas in the other groups."""
        self.remappers = nn.ModuleDict()
        """Managed tables' id remappers, taken over from the ``torchrec-managed`` collection
        (a child module: in the model's state dict, identical on every rank)."""

    # -- construction ----------------------------------------------------------------------------

    @classmethod
    def shard(cls, reference: nn.Module, *, ctx: ParallelContext, options: TorchRecOptions,
              constraints: Mapping[str, Any], two_d: TwoDimGroups | None = None
              ) -> ShardedEmbeddingCollection:
        from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
        from torchrec.distributed.shard import shard_modules
        from torchrec.distributed.types import ShardingEnv
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

        tables = list(reference.table_configs.values())
        self = cls(tables)
        if isinstance(reference, ManagedEmbeddingCollection):
            self.remappers = reference.remappers
        self.train(reference.training)
        self._world_size, self._rank, self._device = ctx.world_size, ctx.rank, ctx.device
        self._group_size = ctx.world_size
        self._optimizer = options.optimizer
        self._lr, self._lr_schedule = options.lr, options.lr_schedule
        weights = {name: reference.tables[name].weight.detach().to(ctx.device)
                   for name in reference.table_configs}
        # Shapes only: shard_modules allocates each rank's shards, filled from the reference below.
        module = _TorchRecTables(tables, torch.device("meta"))
        optimizer_class, optimizer_kwargs = fused_optimizer(options)
        apply_optimizer_in_backward(optimizer_class, module.parameters(), optimizer_kwargs)
        sharders = torchrec_sharders()
        if two_d is not None:  # layout "2d": one group's plan, in this rank's group
            plan, env = two_d.plan(module, sharders, constraints)
        else:
            # The launch's node layout: table_row_wise and grid_shard place shards node by node.
            topology = Topology(world_size=ctx.world_size, compute_device=ctx.device.type,
                                local_world_size=ctx.local_world_size)
            planner = EmbeddingShardingPlanner(
                topology=topology, constraints=dict(constraints))
            pg = dist.group.WORLD
            # Rank 0 plans and broadcasts, so every rank shards the same way.
            plan = planner.collective_plan(module, sharders, pg)
            env = ShardingEnv.from_process_group(pg)
        sharded = shard_modules(module, env=env, plan=plan, sharders=sharders, device=ctx.device)
        self.__dict__["_sharded"] = sharded
        if two_d is not None:
            self._replicas = ReplicaSync(sharded, two_d)
            self._group, self._group_size = two_d.sharding_pg, two_d.layout.group_size
        self.plan = describe_plan(plan)
        self._equal_pooled_batches = ctx.device.type == "cpu" and ctx.is_distributed and any(
            info["sharding_type"] == "table_row_wise" for info in self.plan.values())
        # Sharding initialises the shards afresh: start from the reference's weights instead.
        self._copy_into_shards(weights)
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> ShardedEmbeddingCollection:
        """A local copy that owns no shards (copies of the model, e.g. FSDP2's evaluation
        replica, cannot share the process group's): while this collection is in evaluation
        mode, the copy looks up the full tables it gathered. The tables are in no state dict,
        so filling the copy from one (as the replica is) does not need them."""
        replica = ShardedEmbeddingCollection(list(self.table_configs.values()), local=True)
        replica.plan = copy.deepcopy(self.plan, memo)
        replica.remappers = copy.deepcopy(self.remappers, memo)
        source = self if not self._local else self._source() if self._source else None
        replica._source = weakref.ref(source) if source is not None else None
        replica.train(self.training)
        return replica

    # -- forward ----------------------------------------------------------------------------------

    def forward(self, features: Mapping[str, Jagged]) -> dict[str, Tensor]:
        if len(self.remappers):
            # Training on several ranks: every rank remaps all ranks' ids, so the copies agree.
            features = remap_features(
                self.remappers, self.table_configs, features,
                across_ranks=self.training and not self._local and self._world_size > 1)
        for config in self.table_configs.values():
            for feature in config.features:
                check_ids(features[feature].values, config, feature)
        full = self._full
        if self._local:
            source = self._source() if self._source is not None else None
            full = source._full if source is not None else None
            if full is None:
                raise RuntimeError("this copy of a TorchRec-sharded embedding collection looks "
                                   "up the tables its source gathered for evaluation: call "
                                   "train(False) on the source (every rank together) first")
        if full is not None:
            return {feature: _lookup(full[name], config, features[feature])
                    for name, config in self.table_configs.items()
                    for feature in config.features}
        if not self.training:
            raise RuntimeError("TorchRec-sharded embeddings in eval mode without gathered tables: "
                               "call train(False) on every rank together")
        from torchrec.distributed.comm_ops import get_gradient_division

        sharded = self._sharded
        out: dict[str, Tensor] = {}
        if self._replicas is not None:  # layout "2d": the previous step's update is in
            self._replicas.before_training_step()
        # TorchRec's backward all-to-all divides by the ranks of the group the tables are
        # sharded over (all of them, or a 2D sharding group), as DDP/FSDP2 average.
        scale = 1.0 if get_gradient_division() else 1.0 / self._group_size
        pooled_input, sequence_input = self.lookup_inputs(features)
        if pooled_input is not None:
            batch = features[sharded.pooled_keys[0]].lengths().numel()
            pooled = sharded.ebc(pooled_input).to_dict()
            out.update({k: scale_grad(v[:batch], scale) for k, v in pooled.items()})
        if sequence_input is not None:
            sequences = sharded.ec(sequence_input)
            out.update({k: scale_grad(v.values(), scale) for k, v in sequences.items()})
        dtype = self._dense_dtype()
        if dtype is not None and dtype != torch.float32:
            # The tables stay float32 (TBE). Replicated tables would compute in the dense
            # parameters' dtype (FSDP2 with a bf16 policy casts them): hand the lookups on in
            # it; their gradients come back through the cast in float32.
            out = {k: v.to(dtype) for k, v in out.items()}
        return out

    def lookup_inputs(self, features: Mapping[str, Jagged]) -> tuple[Any, Any]:
        """The ``KeyedJaggedTensor`` s the sharded ``ebc`` (pooled tables) and ``ec`` (sequence
        tables) look up for ``features`` (None where there is no such table), the pooled one
        padded as :meth:`_pad_rows` says. Training only, every rank together (the padding is a
        collective): the forward and the train pipelines (which build them a batch ahead) both
        call it, so their lookups match."""
        sharded = self._sharded
        pooled = sequence = None
        if sharded.ebc is not None:
            batch = features[sharded.pooled_keys[0]].lengths().numel()
            pooled = keyed_jagged(features, sharded.pooled_keys, self._pad_rows(batch))
        if sharded.ec is not None:
            sequence = keyed_jagged(features, sharded.sequence_keys)
        return pooled, sequence

    def _pad_rows(self, batch: int) -> int:
        """Empty requests to append so that every rank looks up as many pooled bags (a
        collective: every rank calls it in every training forward). TorchRec sums a
        ``table_row_wise`` table's partial bags with a reduce-scatter inside the node; with
        batches of different sizes (the balancer's) it is a variable-size one whose backward
        all-gathers tensors of different sizes, which gloo cannot (NCCL can): on CPU the ranks
        pad to the largest batch. Empty bags pool to zero and take no gradient."""
        if not self._equal_pooled_batches:
            return 0
        largest = torch.tensor([batch])
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        return int(largest) - batch

    def _dense_dtype(self) -> torch.dtype | None:
        """The dtype the model's (unsharded) dense parameters have during this forward."""
        from torch.distributed.tensor import DTensor

        root = self._root() if self._root is not None else None
        if root is None:
            return None
        for param in root.parameters():
            # Sharded (DTensor) parameters are the ones not gathered for this forward.
            if param.is_floating_point() and not isinstance(param, DTensor):
                return param.dtype
        return None

    def train(self, mode: bool = True) -> ShardedEmbeddingCollection:
        """Evaluation looks up gathered full tables (collective: every rank calls this
        together, as the trainer's ``engine.train`` does); training frees them."""
        if not self._local:
            if mode:
                self._full = None
            elif self._full is None and self._sharded is not None:
                self._full = self.full_tables()
        return super().train(mode)

    # -- tables and state ----------------------------------------------------------------------

    def _local_shards(self) -> list[tuple[str, list[int], Tensor]]:
        """``(table, offsets, tensor)`` of every shard on this rank (views of the TBE weights)."""
        return [(table, list(shard.metadata.shard_offsets), shard.tensor)
                for table, weight in state.table_weights(self._sharded).items()
                for shard in weight.local_shards()]

    def _copy_into_shards(self, tables: Mapping[str, Tensor]) -> None:
        """Copy this rank's slices of the full ``tables`` into its shards."""
        with torch.no_grad():
            for table, (row, col), tensor in self._local_shards():
                tensor.copy_(tables[table][row:row + tensor.shape[0], col:col + tensor.shape[1]])

    def full_tables(self) -> dict[str, Tensor]:
        """Every table in full on every rank (an all-gather of the shards: collective)."""
        if self._replicas is not None:  # layout "2d": the groups' copies agree first
            self._replicas.sync_pending()
        local = [(t, o, x.detach().cpu().clone()) for t, o, x in self._local_shards()]
        gathered: list[Any] = [local]
        if self._group_size > 1:  # every shard once: from the ranks of this rank's group
            gathered = [None] * self._group_size
            dist.all_gather_object(gathered, local, group=self._group)
        full = {name: torch.empty(c.num_embeddings, c.dim)
                for name, c in self.table_configs.items()}
        covered = {name: 0 for name in full}
        for rank_shards in gathered:
            for table, (row, col), tensor in rank_shards:
                full[table][row:row + tensor.shape[0], col:col + tensor.shape[1]] = tensor
                covered[table] += tensor.numel()
        for name, tensor in full.items():
            if covered[name] != tensor.numel():
                raise RuntimeError(f"table {name!r}: the gathered shards cover "
                                   f"{covered[name]} of {tensor.numel()} values")
        return {name: tensor.to(self._device) for name, tensor in full.items()}

    # -- checkpoints (the protocol of gem_core.checkpoint.sharded_modules) -------------------------

    def follow_learning_rate(self, factor: float) -> float | None:
        """The trainer calls this before every step with the dense schedule's factor (the
        learning rate at the step over ``train.lr``). Returns the sparse learning rate the
        step uses (None for a local copy, which owns no optimizer)."""
        if self._local or self._sharded is None:
            return None
        if self._lr_schedule == "constant":
            return self._lr
        lr = self._lr * factor
        state.set_learning_rate(self._sharded, lr)
        return lr

    def sharded_checkpoint_state(self) -> dict[str, dict[str, Any]]:
        """The tables and their fused-optimizer state as live ``ShardedTensor``s, named as
        :mod:`gem_parallel.torchrec.state` says; DCP writes each rank's shards and loads into
        them in place. Every rank calls it together (layout "2d": the groups' copies are
        averaged first, so that the one DCP writes of each shard is their common value)."""
        self._require_shards("saved or loaded")
        if self._replicas is not None:
            self._replicas.sync_pending()
        return state.checkpoint_state(self._sharded)

    def checkpoint_layout(self) -> dict[str, Any]:
        """Plain data recorded with each checkpoint: what a resume must agree on."""
        self._require_shards("saved or loaded")
        return state.layout(self.plan, self._optimizer)

    def check_checkpoint_layout(self, saved: Mapping[str, Any]) -> None:
        """Refuse (with the reason) a checkpoint whose sparse optimizer state does not fit this
        layout, before anything is loaded."""
        state.check_resume(saved, self.checkpoint_layout())

    def checkpoint_loaded(self) -> None:
        """After DCP loaded into the shards: a gathered evaluation copy follows them (collective,
        as loading is)."""
        if self._replicas is not None:  # every group loaded the same values
            self._replicas.mark_synced()
        if self._full is not None:
            self._full = self.full_tables()

    def sharded_modules(self) -> nn.Module:
        """The sharded TorchRec modules (``ebc``: pooled tables, ``ec``: sequence tables, None
        when there are none; ``pooled_keys``, ``sequence_keys``), for the train pipelines of
        :mod:`gem_parallel.torchrec.pipeline`."""
        self._require_shards("pipelined")
        return self._sharded

    def _require_shards(self, what: str) -> None:
        if self._local or self._sharded is None:
            raise RuntimeError(f"a local copy of a TorchRec-sharded embedding collection owns no "
                               f"shards to be {what}; its source does")
