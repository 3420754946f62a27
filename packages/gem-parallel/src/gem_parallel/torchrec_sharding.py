"""``torchrec``: the embedding tables sharded across ranks by TorchRec (model parallel), while the
dense strategy (``ddp``, ``fsdp2``, ...) keeps the rest data parallel: the 2-D layout of GEM.

What the strategy does to ``model.embeddings`` (a
:class:`gem_core.embedding.ReferenceEmbeddingCollection`, or anything with ``table_configs`` and
``tables.<name>.weight``):

- pooled tables (``sum``/``mean``) become a TorchRec ``EmbeddingBagCollection``, unpooled
  (sequence) tables an ``EmbeddingCollection``; both start from the reference's weights, so the
  outputs are the reference's;
- TorchRec's planner (``EmbeddingShardingPlanner`` over a CPU or CUDA ``Topology``, run on rank
  0 and broadcast) chooses a sharding type and ranks per table among ``table_wise``, ``row_wise``
  and ``column_wise``, or the type given per table by ``plan = {item = "row_wise"}``; the
  modules are sharded with the composable ``shard_modules`` API (FBGEMM TBE kernels, ``fused``)
  and looked up with all-to-alls (ids to the shards' owners, embeddings back);
- what TorchRec 1.8 cannot do is refused with the reason: ``row_wise`` for a pooled table on CPU
  (its ``EmbeddingBagCollectionSharder`` offers it on CUDA only: row-wise pooling sums partial
  bags with a reduce-scatter, which TorchRec does not run over gloo, torchrec issue #1252;
  sequence tables can be row-wise on CPU), a run of one process (sharded tables need a process
  group);
- the tables are updated by TorchRec's fused optimizer inside the backward (FBGEMM TBE on CPU has
  SGD and row-wise Adagrad, not Adam): the dense optimizer never sees them, because the sharded
  modules are kept out of the model's module tree (``parameters()``, ``buffers()``,
  ``named_modules()``): DDP does not all-reduce them, FSDP2 does not shard them, AdamW does not
  own them, with no ignore list to keep in sync;
- the tables get the gradient of the same global-mean loss as the dense parameters: the dense
  strategy averages gradients over ranks, and TorchRec's all-to-all backward divides by the world
  size too (``torchrec.distributed.comm_ops`` gradient division, on by default; were it switched
  off, the lookup outputs scale their gradients by ``1 / world_size`` instead).

Consequences worth knowing:

- gradient clipping (``train.grad_clip``) and the logged ``grad_norm`` cover the dense
  parameters only: fused updates happen during the backward, before a norm could be known;
- a step the guard skips (non-finite loss or gradient norm) has already updated the rows looked
  up in it;
- the sparse learning rate is ``[parallel.embedding] lr``, constant (the run's schedule drives
  the dense AdamW only);
- the tables stay float32 (TBE); the lookups come out in the dtype of the dense parameters
  during the forward, as replicated tables would (bf16 under FSDP2 with a bf16 recipe);
- row-wise Adagrad keeps one sum of squared gradients per row *of each shard*: a column-wise
  table's shards each keep their own, so its updates differ slightly from a table-wise or
  row-wise one's (with SGD every plan gives the same numbers);
- ``train(False)`` (evaluation) is collective: every rank gathers the full tables once, so that
  evaluation, where ranks see different numbers of batches, runs no collective. That needs every
  table to fit on one rank, as does the checkpoint format below.

Checkpoints: ``model.embeddings`` contributes one state-dict entry, ``embeddings._extra_state``
(an object, in the full and in the DCP state dicts alike), holding ``tables`` (every table in
full, unsharded, gathered from its shards: collective, so ``state_dict()`` must run on every rank
together, as the trainer does), ``optimizer`` (each rank's fused-optimizer state, e.g. row-wise
Adagrad's per-row sums, as a list indexed by rank: it loads back only with the same number of
ranks and the same plan, which ``load_state_dict`` checks) and ``plan``. Loading copies each
rank's slices of the full tables into its shards, so a resumed run continues exactly. TorchRec's
own sharded (``ShardedTensor``) state dict is not exposed: the tables are not written shard by
shard, and every rank holds them in full while saving.
"""

from __future__ import annotations

import copy
import logging
import weakref
from typing import Any, Callable, Mapping, Sequence

import attrs
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from gem_core.config import structure
from gem_core.distributed import ParallelContext
from gem_core.embedding import EmbeddingTableConfig, check_ids
from gem_core.errors import GemConfigError
from gem_core.jagged import Jagged

log = logging.getLogger(__name__)

SHARDING_TYPES = ("table_wise", "row_wise", "column_wise")
"""Sharding types this strategy offers (TorchRec's names), where TorchRec's sharders offer them
(see :func:`offered_types`: no ``row_wise`` for pooled tables on CPU)."""

NOT_OFFERED = {
    "data_parallel": "it replicates the table and leaves its gradient to the dense strategy; use "
                     "--embedding-sharding replicated for that",
    "table_row_wise": "it shards within a node's ranks and needs a multi-node topology; with one "
                      "node it is row_wise",
    "table_column_wise": "with one node it is column_wise",
    "grid_shard": "it needs a multi-node topology",
}

SPARSE_OPTIMIZERS = ("rowwise_adagrad", "sgd")


def _plan_validator(instance: Any, attribute: Any, value: Mapping[str, str]) -> None:
    for table, kind in value.items():
        if kind in NOT_OFFERED:
            raise ValueError(f"table {table!r}: sharding type {kind!r} is not offered: "
                             f"{NOT_OFFERED[kind]}")
        if kind not in SHARDING_TYPES:
            raise ValueError(f"table {table!r}: unknown sharding type {kind!r}; choose one of "
                             f"{', '.join(SHARDING_TYPES)}")


@attrs.frozen(kw_only=True)
class TorchRecOptions:
    """``[parallel.embedding]`` of ``torchrec``."""

    plan: dict[str, str] = attrs.field(factory=dict, validator=_plan_validator)
    """Sharding type forced per table (``table_wise``, ``row_wise`` or ``column_wise``); the
    planner chooses for the others, and the ranks for all."""

    optimizer: str = attrs.field(default="rowwise_adagrad",
                                 validator=attrs.validators.in_(SPARSE_OPTIMIZERS))
    """Fused sparse optimizer: ``rowwise_adagrad`` or ``sgd`` (FBGEMM TBE on CPU has no Adam)."""

    lr: float = attrs.field(default=0.02, validator=attrs.validators.gt(0))
    """Learning rate of the fused sparse optimizer (constant)."""

    eps: float = attrs.field(default=1e-8, validator=attrs.validators.gt(0))
    """Row-wise Adagrad's epsilon."""


def parse_options(options: Mapping[str, Any]) -> TorchRecOptions:
    return structure(TorchRecOptions, dict(options), "parallel.embedding")


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


def _scale_grad(x: Tensor, scale: float) -> Tensor:
    return x if scale == 1.0 else _ScaleGrad.apply(x, scale)


def _kjt(features: Mapping[str, Jagged], keys: Sequence[str]) -> Any:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor.from_lengths_sync(
        keys=list(keys),
        values=torch.cat([features[k].values.to(torch.int64) for k in keys]),
        lengths=torch.cat([features[k].lengths().to(torch.int64) for k in keys]),
    )


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


def _fused_optimizer(options: TorchRecOptions) -> tuple[type, dict[str, Any]]:
    if options.optimizer == "sgd":
        return torch.optim.SGD, {"lr": options.lr}
    from torchrec.optim import RowWiseAdagrad

    return RowWiseAdagrad, {"lr": options.lr, "eps": options.eps}


def offered_types(pooled: bool, device_type: str) -> list[str]:
    """The sharding types of :data:`SHARDING_TYPES` that TorchRec's sharder offers for a pooled
    (``EmbeddingBagCollection``) or sequence (``EmbeddingCollection``) table on ``device_type``.

    TorchRec 1.8's ``EmbeddingBagCollectionSharder`` offers ``row_wise`` for pooled tables on
    CUDA only; its ``EmbeddingCollectionSharder`` offers it on CPU too.
    """
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    sharder = EmbeddingBagCollectionSharder() if pooled else EmbeddingCollectionSharder()
    offered = set(sharder.sharding_types(device_type))
    return [kind for kind in SHARDING_TYPES if kind in offered]


def _constraints(tables: Sequence[EmbeddingTableConfig], options: TorchRecOptions,
                 world_size: int, device_type: str) -> dict[str, Any]:
    from torchrec.distributed.planner.types import ParameterConstraints

    unknown = sorted(set(options.plan) - {t.name for t in tables})
    if unknown:
        raise GemConfigError(
            f"parallel.embedding.plan names table {unknown[0]!r}, which the model does not have; "
            f"its tables: {', '.join(t.name for t in tables)}")
    constraints = {}
    for table in tables:
        pooled = table.pooling != "none"
        offered = offered_types(pooled, device_type)
        kind = options.plan.get(table.name)
        if kind is not None and kind not in offered:
            module = "EmbeddingBagCollection" if pooled else "EmbeddingCollection"
            why = (" (row-wise pooling sums partial bags with a reduce-scatter, which TorchRec "
                   "offers on CUDA only: torchrec issue #1252)"
                   if pooled and kind == "row_wise" else "")
            raise GemConfigError(
                f"parallel.embedding.plan: table {table.name!r} cannot be {kind}: it is "
                f"{'pooled' if pooled else 'a sequence table'} (TorchRec {module}) and TorchRec's "
                f"sharder offers only {', '.join(offered)} for those on {device_type}{why}")
        if kind == "column_wise" and table.dim % world_size:
            raise GemConfigError(
                f"parallel.embedding.plan: table {table.name!r} is column_wise but its width "
                f"{table.dim} does not split evenly over {world_size} ranks")
        if kind == "row_wise" and table.num_embeddings < world_size:
            raise GemConfigError(
                f"parallel.embedding.plan: table {table.name!r} is row_wise but has "
                f"{table.num_embeddings} rows for {world_size} ranks")
        # column_wise: one shard per rank (TorchRec's default minimum shard width, 128, would
        # leave a narrow table in one piece on one rank).
        constraints[table.name] = ParameterConstraints(
            sharding_types=[kind] if kind else offered, compute_kernels=["fused"],
            min_partition=max(table.dim // world_size, 1))
    return constraints


def describe_plan(plan: Any) -> dict[str, dict[str, Any]]:
    """Per table: sharding type, the ranks holding it and each shard's (rows, columns)."""
    out: dict[str, dict[str, Any]] = {}
    for module_plan in plan.plan.values():
        for table, sharding in module_plan.items():
            shards = []
            if sharding.sharding_spec is not None:
                shards = [{"rank": s.placement.rank(), "offsets": list(s.shard_offsets),
                           "sizes": list(s.shard_sizes)}
                          for s in sharding.sharding_spec.shards]
            out[table] = {"sharding_type": sharding.sharding_type,
                          "compute_kernel": sharding.compute_kernel,
                          "ranks": list(sharding.ranks or []), "shards": shards}
    return dict(sorted(out.items()))


def _lookup(weight: Tensor, config: EmbeddingTableConfig, jagged: Jagged) -> Tensor:
    if config.pooling == "none":
        return F.embedding(jagged.values, weight)
    return F.embedding_bag(jagged.values, weight, jagged.offsets[:-1], mode=config.pooling)


class ShardedEmbeddingCollection(nn.Module):
    """``model.embeddings`` after the ``torchrec`` strategy: same forward as the reference.

    The TorchRec modules live outside the module tree (see the module docstring); ``plan``
    describes where every table went.
    """

    def __init__(self, tables: Sequence[EmbeddingTableConfig], *, local: bool = False) -> None:
        super().__init__()
        self.table_configs = {t.name: t for t in tables}
        self.plan: dict[str, dict[str, Any]] = {}
        self._local = local
        self._full: dict[str, Tensor] | None = None
        self.__dict__["_sharded"] = None  # not a child module, on purpose
        self._root: Callable[[], nn.Module | None] | None = None
        """Weak reference to the model holding this collection (for the dense dtype)."""
        self._world_size, self._rank, self._device = 1, 0, torch.device("cpu")

    # -- construction ----------------------------------------------------------------------------

    @classmethod
    def shard(cls, reference: nn.Module, *, ctx: ParallelContext, options: TorchRecOptions,
              constraints: Mapping[str, Any]) -> ShardedEmbeddingCollection:
        from torchrec.distributed.embedding import EmbeddingCollectionSharder
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
        from torchrec.distributed.shard import shard_modules
        from torchrec.distributed.types import ShardingEnv
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

        tables = list(reference.table_configs.values())
        self = cls(tables)
        self.train(reference.training)
        self._world_size, self._rank, self._device = ctx.world_size, ctx.rank, ctx.device
        weights = {name: reference.tables[name].weight.detach().to(ctx.device)
                   for name in reference.table_configs}
        # Shapes only: shard_modules allocates each rank's shards, filled from the reference below.
        module = _TorchRecTables(tables, torch.device("meta"))
        optimizer_class, optimizer_kwargs = _fused_optimizer(options)
        apply_optimizer_in_backward(optimizer_class, module.parameters(), optimizer_kwargs)
        sharders = [EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()]
        topology = Topology(world_size=ctx.world_size, compute_device=ctx.device.type,
                            local_world_size=ctx.world_size)
        planner = EmbeddingShardingPlanner(
            topology=topology, constraints=dict(constraints))
        pg = dist.group.WORLD
        # Rank 0 plans and broadcasts, so every rank shards the same way.
        plan = planner.collective_plan(module, sharders, pg)
        env = ShardingEnv.from_process_group(pg)
        sharded = shard_modules(module, env=env, plan=plan, sharders=sharders, device=ctx.device)
        self.__dict__["_sharded"] = sharded
        self.plan = describe_plan(plan)
        # Sharding initialises the shards afresh: start from the reference's weights instead.
        self._copy_into_shards(weights)
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> ShardedEmbeddingCollection:
        """A local (unsharded) copy with no tables yet: ``load_state_dict`` fills it. (Copies of
        the model, e.g. FSDP2's evaluation replica, cannot share the process group's shards.)"""
        replica = ShardedEmbeddingCollection(list(self.table_configs.values()), local=True)
        replica.plan = copy.deepcopy(self.plan, memo)
        replica.train(self.training)
        return replica

    # -- forward ----------------------------------------------------------------------------------

    def forward(self, features: Mapping[str, Jagged]) -> dict[str, Tensor]:
        for name, config in self.table_configs.items():
            for feature in config.features:
                check_ids(features[feature].values, config, feature)
        if self._full is not None:
            return {feature: _lookup(self._full[name], config, features[feature])
                    for name, config in self.table_configs.items()
                    for feature in config.features}
        if self._local:
            raise RuntimeError("this copy of a TorchRec-sharded embedding collection holds no "
                               "tables until load_state_dict fills it")
        if not self.training:
            raise RuntimeError("TorchRec-sharded embeddings in eval mode without gathered tables: "
                               "call train(False) on every rank together")
        from torchrec.distributed.comm_ops import get_gradient_division

        sharded = self._sharded
        out: dict[str, Tensor] = {}
        # TorchRec's backward all-to-all divides by the world size, as DDP/FSDP2 average.
        scale = 1.0 if get_gradient_division() else 1.0 / self._world_size
        if sharded.ebc is not None:
            pooled = sharded.ebc(_kjt(features, sharded.pooled_keys)).to_dict()
            out.update({k: _scale_grad(v, scale) for k, v in pooled.items()})
        if sharded.ec is not None:
            sequences = sharded.ec(_kjt(features, sharded.sequence_keys))
            out.update({k: _scale_grad(v.values(), scale) for k, v in sequences.items()})
        dtype = self._dense_dtype()
        if dtype is not None and dtype != torch.float32:
            # The tables stay float32 (TBE). Replicated tables would compute in the dense
            # parameters' dtype (FSDP2 with a bf16 policy casts them): hand the lookups on in
            # it; their gradients come back through the cast in float32.
            out = {k: v.to(dtype) for k, v in out.items()}
        return out

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
        from torch.distributed._shard.sharded_tensor import ShardedTensor
        from torch.distributed.tensor import DTensor

        shards = []
        sharded = self._sharded
        for prefix, module in (("embedding_bags.", sharded.ebc), ("embeddings.", sharded.ec)):
            if module is None:
                continue
            for key, value in module.state_dict(keep_vars=True).items():
                table = key[len(prefix):].rsplit(".", 1)[0]
                if isinstance(value, ShardedTensor):
                    for shard in value.local_shards():
                        shards.append((table, list(shard.metadata.shard_offsets), shard.tensor))
                elif isinstance(value, DTensor):
                    raise RuntimeError(f"table {table!r}: DTensor shards are not handled here")
                else:
                    shards.append((table, [0, 0], value))
        return shards

    def _copy_into_shards(self, tables: Mapping[str, Tensor]) -> None:
        """Copy this rank's slices of the full ``tables`` into its shards."""
        with torch.no_grad():
            for table, (row, col), tensor in self._local_shards():
                tensor.copy_(tables[table][row:row + tensor.shape[0], col:col + tensor.shape[1]])

    def full_tables(self) -> dict[str, Tensor]:
        """Every table in full on every rank (an all-gather of the shards: collective)."""
        local = [(t, o, x.detach().cpu().clone()) for t, o, x in self._local_shards()]
        gathered: list[Any] = [local]
        if self._world_size > 1:
            gathered = [None] * self._world_size
            dist.all_gather_object(gathered, local)
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

    def _optimizer_states(self) -> dict[str, list[Tensor]]:
        from torch.distributed._shard.sharded_tensor import ShardedTensor

        states: dict[str, list[Tensor]] = {}
        for part in ("ebc", "ec"):
            module = getattr(self._sharded, part)
            if module is None:
                continue
            for param_key, values in module.fused_optimizer.state_dict()["state"].items():
                for name, value in values.items():
                    key = f"{part}/{param_key}/{name}"
                    if isinstance(value, ShardedTensor):
                        states[key] = [s.tensor for s in value.local_shards()]
                    elif isinstance(value, Tensor):
                        states[key] = [value]
        return states

    def get_extra_state(self) -> dict[str, Any]:
        if self._local:
            return {"tables": {k: v.detach().clone() for k, v in (self._full or {}).items()},
                    "plan": self.plan, "optimizer": None}
        tables = {k: v.cpu() for k, v in self.full_tables().items()}
        mine = {k: [t.detach().cpu().clone() for t in v]
                for k, v in self._optimizer_states().items()}
        optimizer: list[Any] = [mine]
        if self._world_size > 1:
            optimizer = [None] * self._world_size
            dist.all_gather_object(optimizer, mine)
        return {"tables": tables, "plan": self.plan, "optimizer": optimizer}

    def set_extra_state(self, state: Mapping[str, Any]) -> None:
        tables = state["tables"]
        missing = sorted(set(self.table_configs) - set(tables))
        if missing:
            raise RuntimeError(f"embedding state lacks tables {missing}")
        if self._local:
            self._full = {k: v.detach().clone() for k, v in tables.items()}
            return
        self._copy_into_shards(tables)
        if self._full is not None:  # evaluating: the gathered copy follows the shards
            self._full = {name: tables[name].detach().to(self._device).clone()
                          for name in self.table_configs}
        optimizer = state.get("optimizer")
        if optimizer is None:
            return
        if len(optimizer) != self._world_size or state.get("plan") != self.plan:
            raise RuntimeError(
                f"the checkpoint's sparse optimizer state was written by {len(optimizer)} ranks "
                f"with another plan or rank count than this run's ({self._world_size} ranks); "
                "it can only be loaded by the same layout")
        saved = optimizer[self._rank]
        current = self._optimizer_states()
        if set(saved) != set(current):
            raise RuntimeError(f"sparse optimizer state keys differ: saved {sorted(saved)}, "
                               f"here {sorted(current)}")
        with torch.no_grad():
            for key, tensors in current.items():
                for target, value in zip(tensors, saved[key], strict=True):
                    target.copy_(value)


class TorchRecSharding:
    """The ``torchrec`` embedding sharding strategy. After ``apply``, ``summary()`` holds the
    plan (the trainer writes it to ``summary.json``)."""

    def __init__(self) -> None:
        self.plan: dict[str, dict[str, Any]] = {}
        self.options: TorchRecOptions | None = None

    def apply(self, model: nn.Module, *, ctx: ParallelContext, options: Mapping[str, Any]):
        opts = parse_options(options)
        reference = getattr(model, "embeddings", None)
        if reference is None or not hasattr(reference, "table_configs") \
                or not hasattr(reference, "tables"):
            raise GemConfigError(
                "embedding_sharding 'torchrec' shards model.embeddings built by the 'reference' "
                f"embedding backend; this model's is {type(reference).__name__}")
        # The plan is checked first, so that a mistake in it is named whatever the launch.
        constraints = _constraints(list(reference.table_configs.values()), opts,
                                   ctx.world_size, ctx.device.type)
        if not ctx.is_distributed:
            raise GemConfigError(
                "embedding_sharding 'torchrec' shards tables across ranks but this run has one "
                "process (TorchRec's sharded tables need a process group); launch several "
                "(gem train --nproc-per-node N) or use --embedding-sharding replicated")
        if ctx.device.type not in ("cpu", "cuda"):
            raise GemConfigError(f"embedding_sharding 'torchrec' runs on cpu or cuda, not "
                                 f"{ctx.device.type}")
        sharded = ShardedEmbeddingCollection.shard(reference, ctx=ctx, options=opts,
                                                   constraints=constraints)
        sharded._root = weakref.ref(model)
        model.embeddings = sharded
        self.plan, self.options = sharded.plan, opts
        if ctx.is_main:
            for table, info in sharded.plan.items():
                log.info("torchrec plan: table %s %s on ranks %s (shards %s)", table,
                         info["sharding_type"], info["ranks"],
                         [tuple(s["sizes"]) for s in info["shards"]])
        return model

    def summary(self) -> dict[str, Any]:
        """The plan per table and the sparse optimizer, for ``summary.json``."""
        if self.options is None:
            return {}
        return {"plan": self.plan,
                "sparse_optimizer": {"name": self.options.optimizer, "lr": self.options.lr,
                                     "fused_in_backward": True}}
