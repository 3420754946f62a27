"""Planning for the ``torchrec`` embedding sharding: the ``[parallel.embedding]`` options, which
sharding types TorchRec offers per table and device, the planner's constraints, and the plan as
``summary.json`` reports it."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import attrs
import torch

from gem_core.config import structure
from gem_core.embedding import EmbeddingTableConfig
from gem_core.errors import GemConfigError

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

PIPELINES = ("none", "sparse-dist", "semi-sync")
"""``[parallel.embedding] pipeline``: the train pipelines offered (see ``TorchRecOptions``)."""


def _plan_validator(instance: Any, attribute: Any, value: Mapping[str, str]) -> None:
    for table, kind in value.items():
        if kind in NOT_OFFERED:
            raise ValueError(f"table {table!r}: sharding type {kind!r} is not offered: "
                             f"{NOT_OFFERED[kind]}")
        if kind not in SHARDING_TYPES:
            raise ValueError(f"table {table!r}: unknown sharding type {kind!r}; choose one of "
                             f"{', '.join(SHARDING_TYPES)}")


LR_SCHEDULES = ("constant", "dense")


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
    """Learning rate of the fused sparse optimizer (its peak, with ``lr_schedule = "dense"``)."""

    lr_schedule: str = attrs.field(default="constant",
                                   validator=attrs.validators.in_(LR_SCHEDULES))
    """``constant``: ``lr`` at every step (the usual choice with row-wise Adagrad, whose per-row
    sums already shrink the steps of frequent rows); ``dense``: ``lr`` times the run's warmup
    and decay factor, the dense learning rate at the step divided by ``train.lr``."""

    eps: float = attrs.field(default=1e-8, validator=attrs.validators.gt(0))
    """Row-wise Adagrad's epsilon."""

    pipeline: str = attrs.field(default="none", validator=attrs.validators.in_(PIPELINES))
    """How steps overlap the lookups' communication (:mod:`gem_parallel.torchrec_pipeline`):
    ``none``, each step distributes its own ids; ``sparse-dist``, TorchRec's
    ``TrainPipelineSparseDist`` sends the ids of the next batch to the tables' owners while
    this batch computes (same numbers as ``none``); ``semi-sync``, TorchRec's
    ``TrainPipelineSemiSync`` also looks up the next batch's vectors before this batch's sparse
    update (the lookups are one step stale: close to ``none``, not equal)."""


def parse_options(options: Mapping[str, Any]) -> TorchRecOptions:
    return structure(TorchRecOptions, dict(options), "parallel.embedding")


def fused_optimizer(options: TorchRecOptions) -> tuple[type, dict[str, Any]]:
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


def planner_constraints(tables: Sequence[EmbeddingTableConfig], options: TorchRecOptions,
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
