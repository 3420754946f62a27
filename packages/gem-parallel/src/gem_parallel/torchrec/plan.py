"""Planning for the ``torchrec`` embedding sharding: the ``[parallel.embedding]`` options, which
sharding types TorchRec offers per table and device, the planner's constraints, and the plan as
``summary.json`` reports it."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import attrs
import torch

from gem_core.config import structure
from gem_core.config.validators import Rule, at_least, choice, greater_than, optional
from gem_core.embedding import EmbeddingTableConfig
from gem_core.errors import GemConfigError
from gem_core.kinds import kind_named

SHARDING_TYPES = ("table_wise", "row_wise", "column_wise")
"""Sharding types this strategy offers (TorchRec's names), where TorchRec's sharders offer them
(see :func:`offered_types`: no ``row_wise`` for pooled tables on CPU)."""

MULTI_NODE_TYPES = ("table_row_wise", "grid_shard")
"""Sharding types that follow the node layout of the launch, offered only when a plan names
them and the run has more than one node: ``table_row_wise`` puts a table on one node and
splits its rows over that node's ranks (the lookups' partial bags are summed inside the node,
only the pooled vectors cross nodes); ``grid_shard`` splits a table's columns over the nodes and
the rows of each column block over a node's ranks. Pooled tables only (TorchRec's
``EmbeddingCollection`` has neither)."""

NOT_OFFERED = {
    "data_parallel": "it replicates the table and leaves its gradient to the dense strategy; use "
                     "--embedding-sharding replicated for that",
    "table_column_wise": "column_wise already keeps a table's column shards where the planner "
                         "puts them",
}

ONE_NODE = {
    "table_row_wise": "it splits a table's rows over the ranks of one node and places tables "
                      "on nodes; with one node that is row_wise",
    "grid_shard": "it splits a table's columns over the nodes and each column block's rows over "
                  "a node's ranks; with one node that is row_wise",
}
"""Why a multi-node type is refused when the run has one node."""

CPU_GRID_SHARD = (
    "TorchRec 1.8's grid-sharded lookups over gloo do not equal the unsharded table's "
    "(measured on 2 nodes x 2 CPU ranks: pooled outputs off by up to 0.4 with unit-scale "
    "weights, while table_row_wise agreed to 1e-7); it is offered on CUDA, or use "
    "table_row_wise or column_wise on CPU")
"""Why ``grid_shard`` is refused on CPU."""

SPARSE_OPTIMIZERS = ("rowwise_adagrad", "sgd")

PIPELINES = ("none", "sparse-dist", "semi-sync")
"""``[parallel.embedding] pipeline``: the train pipelines offered (see ``TorchRecOptions``)."""


@attrs.frozen
class _PlanRule(Rule):
    """Each table's sharding type is one offered."""

    def __call__(self, instance: Any, attribute: Any, value: Mapping[str, str]) -> None:
        for table, kind in value.items():
            if kind in NOT_OFFERED:
                raise ValueError(f"table {table!r}: sharding type {kind!r} is not offered: "
                                 f"{NOT_OFFERED[kind]}")
            if kind not in SHARDING_TYPES + MULTI_NODE_TYPES:
                raise ValueError(f"table {table!r}: unknown sharding type {kind!r}; choose one "
                                 f"of {', '.join(SHARDING_TYPES + MULTI_NODE_TYPES)}")

    @property
    def rule(self) -> str:
        return "each table's value one of " + ", ".join(SHARDING_TYPES + MULTI_NODE_TYPES)


LR_SCHEDULES = ("constant", "dense")

SPARSE_LAYOUTS = ("model_parallel", "2d")
"""``[parallel.embedding] layout``: tables over all ranks, or TorchRec's 2D layout."""


@attrs.frozen(kw_only=True)
class TorchRecOptions:
    """``[parallel.embedding]`` of ``torchrec``."""

    plan: dict[str, str] = attrs.field(factory=dict, validator=_PlanRule())
    """Sharding type forced per table (``table_wise``, ``row_wise`` or ``column_wise``; with
    more than one node also ``table_row_wise`` and, on CUDA, ``grid_shard`` for pooled tables);
    the planner chooses among the first three for the others, and the ranks for all."""

    optimizer: str = attrs.field(default="rowwise_adagrad",
                                 validator=choice(*SPARSE_OPTIMIZERS))
    """Fused sparse optimizer: ``rowwise_adagrad`` or ``sgd`` (FBGEMM TBE on CPU has no Adam)."""

    lr: float = attrs.field(default=0.02, validator=greater_than(0))
    """Learning rate of the fused sparse optimizer (its peak, with ``lr_schedule = "dense"``)."""

    lr_schedule: str = attrs.field(default="constant",
                                   validator=choice(*LR_SCHEDULES))
    """``constant``: ``lr`` at every step (the usual choice with row-wise Adagrad, whose per-row
    sums already shrink the steps of frequent rows); ``dense``: ``lr`` times the run's warmup
    and decay factor, the dense learning rate at the step divided by ``train.lr``."""

    eps: float = attrs.field(default=1e-8, validator=greater_than(0))
    """Row-wise Adagrad's epsilon."""

    pipeline: str = attrs.field(default="none", validator=choice(*PIPELINES))
    """How steps overlap the lookups' communication (:mod:`gem_parallel.torchrec.pipeline`):
    ``none``, each step distributes its own ids; ``sparse-dist``, TorchRec's
    ``TrainPipelineSparseDist`` sends the ids of the next batch to the tables' owners while
    this batch computes (same numbers as ``none``); ``semi-sync``, TorchRec's
    ``TrainPipelineSemiSync`` also looks up the next batch's vectors before this batch's sparse
    update (the lookups are one step stale: close to ``none``, not equal)."""

    layout: str = attrs.field(default="model_parallel",
                              validator=choice(*SPARSE_LAYOUTS))
    """``model_parallel``: every table sharded over all ranks; ``2d``: sharded over a group of
    ``sharding_group_size`` ranks and replicated over the ``world / sharding_group_size`` groups,
    the replicas averaged every ``sync_every`` steps (TorchRec's ``DMPCollection`` layout, see
    :mod:`gem_parallel.torchrec.two_d`)."""

    sharding_group_size: int | None = attrs.field(
        default=None, validator=optional(at_least(1)))
    """``layout = "2d"``: ranks per sharding group (it must divide the number of ranks);
    required there, refused with ``model_parallel``."""

    sync_every: int = attrs.field(default=1, validator=at_least(1))
    """``layout = "2d"``: average the replicas every this many steps (TorchRec's train
    pipeline default: 1); checkpoints and evaluations average them first whatever the count."""

    sync_optimizer_state: bool = True
    """``layout = "2d"``: average the fused optimizer's state (row-wise Adagrad's sums) with the
    weights, as ``DMPCollection.sync()`` does by default."""


def parse_options(options: Mapping[str, Any]) -> TorchRecOptions:
    """``options`` as a run structures its ``[parallel.embedding]`` (for tests and tools that
    start from a table)."""
    return structure(TorchRecOptions, dict(options), kind_named("embedding_sharding").options_key)


def fused_optimizer(options: TorchRecOptions) -> tuple[type, dict[str, Any]]:
    if options.optimizer == "sgd":
        return torch.optim.SGD, {"lr": options.lr}
    from torchrec.optim import RowWiseAdagrad

    return RowWiseAdagrad, {"lr": options.lr, "eps": options.eps}


def sharders() -> list[Any]:
    """The sharders of the pooled and the sequence tables' TorchRec modules."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    class PooledTablesSharder(EmbeddingBagCollectionSharder):
        """TorchRec's sharder of pooled tables, plus ``table_row_wise`` on CPU: TorchRec 1.8
        offers it on CUDA only, but its intra-node reduce-scatter runs over gloo (torch 2.13)
        and the lookups, gradients and checkpoints agree with one process (measured and tested
        on 2 nodes x 2 CPU ranks)."""

        def sharding_types(self, compute_device_type: str) -> list[str]:
            types = list(super().sharding_types(compute_device_type))
            if compute_device_type == "cpu" and "table_row_wise" not in types:
                types.append("table_row_wise")
            return types

    return [PooledTablesSharder(), EmbeddingCollectionSharder()]


def offered_types(pooled: bool, device_type: str, num_nodes: int = 1) -> list[str]:
    """The sharding types a plan may name for a pooled (``EmbeddingBagCollection``) or sequence
    (``EmbeddingCollection``) table on ``device_type``: those of :data:`SHARDING_TYPES` that
    TorchRec's sharder offers, and with more than one node those of :data:`MULTI_NODE_TYPES`.

    TorchRec 1.8's ``EmbeddingBagCollectionSharder`` offers ``row_wise`` for pooled tables on
    CUDA only; its ``EmbeddingCollectionSharder`` offers it on CPU too.
    """
    pooled_sharder, sequence_sharder = sharders()
    offered = set((pooled_sharder if pooled else sequence_sharder).sharding_types(device_type))
    kinds = SHARDING_TYPES + (MULTI_NODE_TYPES if num_nodes > 1 else ())
    return [kind for kind in kinds if kind in offered]


def planner_constraints(tables: Sequence[EmbeddingTableConfig], options: TorchRecOptions,
                        world_size: int, device_type: str, *,
                        local_world_size: int | None = None) -> dict[str, Any]:
    """The planner's constraints per table, after checking the forced plan against the tables,
    the device and the node layout (``local_world_size`` ranks per node; None: one node)."""
    from torchrec.distributed.planner.types import ParameterConstraints

    local_world_size = local_world_size or world_size
    num_nodes = world_size // local_world_size

    unknown = sorted(set(options.plan) - {t.name for t in tables})
    if unknown:
        raise GemConfigError(
            f"parallel.embedding.plan names table {unknown[0]!r}, which the model does not have; "
            f"its tables: {', '.join(t.name for t in tables)}")
    constraints = {}
    for table in tables:
        pooled = table.pooling != "none"
        offered = offered_types(pooled, device_type, num_nodes)
        kind = options.plan.get(table.name)
        if kind in MULTI_NODE_TYPES and num_nodes == 1:
            raise GemConfigError(
                f"parallel.embedding.plan: table {table.name!r} cannot be {kind} on one node "
                f"({world_size} rank(s)): {ONE_NODE[kind]}. It needs a launch of several nodes "
                "(gem train --nnodes N ...)")
        if kind == "grid_shard" and device_type == "cpu":
            raise GemConfigError(f"parallel.embedding.plan: table {table.name!r} cannot be "
                                 f"grid_shard on cpu: {CPU_GRID_SHARD}")
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
        if kind in MULTI_NODE_TYPES and table.num_embeddings < local_world_size:
            raise GemConfigError(
                f"parallel.embedding.plan: table {table.name!r} is {kind} but has "
                f"{table.num_embeddings} rows for the {local_world_size} ranks of a node")
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
