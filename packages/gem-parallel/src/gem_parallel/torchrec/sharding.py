"""``torchrec``: the embedding tables sharded across ranks by TorchRec (model parallel), while the
dense strategy (``ddp``, ``fsdp2``, ...) keeps the rest data parallel: the 2-D layout of GEM.

What the strategy does to ``model.embeddings`` (a
:class:`gem_core.embedding.ReferenceEmbeddingCollection`, or anything with ``table_configs`` and
``tables.<name>.weight``):

- pooled tables (``sum``/``mean``: the context features') become a TorchRec
  ``EmbeddingBagCollection``, unpooled (event and candidate) tables an ``EmbeddingCollection``;
  both start from the reference's weights, so the outputs are the reference's. A table keeps
  every feature key that indexes it (:func:`gem_core.model.features.embedding_tables`): the ad
  table shared by ``event.ad_id`` and ``candidate.ad_id`` is one TorchRec table with both
  feature names, sharded once. Every key arrives as one jagged row per request (the stride a
  ``KeyedJaggedTensor`` needs for all keys; a request's row holds the ids of all its events, or
  of all its candidates), already mapped to rows by the table's id policy; multi-valued event
  and candidate features are looked up unpooled like the others and pooled per event (or per
  candidate) by the model's :class:`~gem_core.model.features.FeatureLookup`;
- TorchRec's planner (``EmbeddingShardingPlanner`` over a CPU or CUDA ``Topology``, run on rank
  0 and broadcast) chooses a sharding type and ranks per table among ``table_wise``, ``row_wise``
  and ``column_wise``, or the type given per table by ``plan = {item = "row_wise"}``
  (:mod:`gem_parallel.torchrec.plan`); the modules are sharded with the composable
  ``shard_modules`` API (FBGEMM TBE kernels, ``fused``) and looked up with all-to-alls (ids to
  the shards' owners, embeddings back);
- what TorchRec 1.8 cannot do is refused with the reason: ``row_wise`` for a pooled table on CPU
  (its ``EmbeddingBagCollectionSharder`` offers it on CUDA only: row-wise pooling sums partial
  bags with a reduce-scatter, which TorchRec does not run over gloo, torchrec issue #1252;
  sequence tables can be row-wise on CPU);
- tables with ``id_policy = "managed"`` keep the remappers of the ``torchrec-managed`` embedding
  backend (:mod:`gem_parallel.torchrec.managed`) as ``remappers.<table>``: in training every rank
  remaps all ranks' ids of the lookup (an all-gather of the raw ids, in rank order), so the
  copies stay identical and an id has one row everywhere, whatever the plan (``row_wise``, the
  layout TorchRec's own sharded managed-collision collections use, suits such tables); in
  evaluation the remap is a local look-up that inserts nothing;
- one process runs TorchRec in a process group of one rank (gloo; NCCL too on CUDA) that the
  strategy starts itself: every table is then one shard on that rank, and the run keeps the
  fused optimizer and its state (a checkpoint of N ranks resumes on one process this way);
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
- the sparse learning rate is ``[parallel.embedding] lr``, constant by default; with
  ``lr_schedule = "dense"`` it follows the run's warmup and decay (``sparse_lr`` in
  ``metrics.jsonl``);
- the tables stay float32 (TBE); the lookups come out in the dtype of the dense parameters
  during the forward, as replicated tables would (bf16 under FSDP2 with a bf16 recipe);
- row-wise Adagrad keeps one sum of squared gradients per row *of each shard*: a column-wise
  table's shards each keep their own, so its updates differ slightly from a table-wise or
  row-wise one's (with SGD every plan gives the same numbers);
- ``train(False)`` (evaluation) is collective: every rank gathers the full tables once, so that
  evaluation, where ranks see different numbers of batches, runs no collective. That needs every
  table to fit on one rank (checkpoints do not: see below).

Checkpoints: the collection has nothing in the model's state dict; it hands the checkpointer
(:mod:`gem_core.checkpoint.sharded_modules`) each table and its fused-optimizer state
as TorchRec's ``ShardedTensor``s under the replicated backend's names
(:mod:`gem_parallel.torchrec.state`): every rank writes its own shards and DCP reshards them for
another plan or number of ranks, except row-wise Adagrad's state of a table whose number of
column shards changed, which is refused with the reason.

This module is the strategy (:class:`TorchRecSharding`: checks, plan, memory estimate, step
runner, summary); the collection it puts in ``model.embeddings`` is
:class:`~gem_parallel.torchrec.collection.ShardedEmbeddingCollection`.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from torch import nn

from gem_core.contracts import EmbeddingSharding, StepRunner, TrainStream
from gem_core.distributed import ParallelContext, single_process_group
from gem_core.errors import GemConfigError
from gem_core.plan_estimate import (
    GRADIENTS,
    OPTIMIZER_STATE,
    PARAMETERS,
    Estimate,
    MemoryRow,
    PlanFacts,
)
from gem_core.schema import FeatureSchema
from gem_parallel.torchrec import two_d
from gem_parallel.torchrec.collection import ShardedEmbeddingCollection
from gem_parallel.torchrec.managed import ManagedEmbeddingCollection
from gem_parallel.torchrec.plan import TorchRecOptions, planner_constraints

log = logging.getLogger(__name__)


class TorchRecSharding(EmbeddingSharding):
    """The ``torchrec`` embedding sharding strategy. After ``apply``, ``summary()`` holds the
    plan (the trainer writes it to ``summary.json``)."""

    def __init__(self) -> None:
        self.plan: dict[str, dict[str, Any]] = {}
        self.options: TorchRecOptions | None = None
        self.layout: two_d.SparseLayout | None = None
        self._collection: ShardedEmbeddingCollection | None = None
        self.shard_bytes: list[dict[str, int]] = []
        self.pipeline: Any = None
        """The ``PipelinedSteps`` of ``[parallel.embedding] pipeline`` (None: ``none``)."""

    def apply(self, model: nn.Module, *, ctx: ParallelContext, options: TorchRecOptions):
        opts = options
        reference = getattr(model, "embeddings", None)
        if reference is None or not hasattr(reference, "table_configs") \
                or not hasattr(reference, "tables"):
            raise GemConfigError(
                "embedding_sharding 'torchrec' shards a model.embeddings that keeps its tables "
                "as modules (table_configs and tables, as gem-core's reference embedding "
                f"backend does); this model's is {type(reference).__name__}")
        managed = [t.name for t in reference.table_configs.values() if t.managed is not None]
        if managed and not isinstance(reference, ManagedEmbeddingCollection):
            raise GemConfigError(
                f"table(s) {', '.join(managed)} have id_policy 'managed': embedding_sharding "
                "'torchrec' takes their remappers from the 'torchrec-managed' embedding backend; "
                f"this model's embeddings are a {type(reference).__name__}")
        # The plan is checked first, so that a mistake in it is named whatever the launch.
        # Layout "2d" plans one sharding group (its ranks as one node).
        layout = two_d.resolve(opts, ctx.world_size)
        constraints = planner_constraints(
            list(reference.table_configs.values()), opts,
            ctx.world_size if layout is None else layout.group_size, ctx.device.type,
            local_world_size=ctx.local_world_size if layout is None else layout.group_size)
        if ctx.device.type not in ("cpu", "cuda"):
            raise GemConfigError(f"embedding_sharding 'torchrec' runs on cpu or cuda, not "
                                 f"{ctx.device.type}")
        if not ctx.is_distributed:
            # TorchRec shards over a process group: one process gets a group of one rank, in
            # which every table is one shard. The run keeps TorchRec's fused optimizer, so a
            # checkpoint of several ranks continues here with its sparse optimizer state rather
            # than switching the tables to AdamW. The trainer's shutdown ends the group.
            single_process_group(ctx)
        # One group (G = every rank) is the model-parallel layout: no replicas to average.
        groups = (two_d.TwoDimGroups(layout, ctx.device)
                  if layout is not None and layout.groups > 1 else None)
        sharded = ShardedEmbeddingCollection.shard(reference, ctx=ctx, options=opts,
                                                   constraints=constraints, two_d=groups)
        sharded._root = weakref.ref(model)
        model.embeddings = sharded
        self.plan, self.options = sharded.plan, opts
        self.layout, self._collection = layout, sharded
        self.shard_bytes = two_d.gather_shard_bytes(sharded.sharded_modules(),
                                                          ctx.world_size)
        if ctx.is_main and layout is not None:
            log.info("torchrec layout 2d: %d sharding group(s) of %d ranks %s, %s",
                     layout.groups, layout.group_size, layout.group_ranks(),
                     f"replicas averaged every {layout.sync_every} step(s)" if layout.groups > 1
                     else "no replicas (one group is the model_parallel layout)")
        if ctx.is_main:
            for table, info in sharded.plan.items():
                log.info("torchrec plan: table %s %s on ranks %s (shards %s)", table,
                         info["sharding_type"], info["ranks"],
                         [tuple(s["sizes"]) for s in info["shards"]])
        return model

    def plan_estimate(self, facts: PlanFacts, options: TorchRecOptions) -> Estimate:
        """Rows spread evenly over the ranks (row- or column-wise; a table-wise table sits whole
        on one rank: ``bytes_on_one_rank_if_table_wise``) with the fused optimizer's state (one
        float32 accumulator per row for row-wise Adagrad, none for SGD) and no gradient
        buffers (the optimizer runs in the backward). Lookups of this rank's requests go out to
        the table owners and their gradients come back: a forward and a backward all-to-all of
        one vector per id of every sequence feature and one per bag of a pooled feature."""
        opts = options
        layout = two_d.resolve(opts, facts.world_size)  # "2d": one group's ranks
        n = facts.world_size if layout is None else layout.group_size
        state_per_row = 4 if opts.optimizer == "rowwise_adagrad" else 0
        rows = sum(t.num_embeddings for t in facts.tables)
        tables: dict[str, dict[str, Any]] = {}
        for table in facts.tables:
            state = table.num_embeddings * state_per_row
            tables[table.name] = {
                "bytes_per_rank": int((table.parameters * 4 + state) / n),
                "bytes_on_one_rank_if_table_wise": table.parameters * 4 + state,
                "comm_bytes_per_rank_per_step": int(2 * (n - 1) / n * table.vectors_per_request
                                                    * facts.requests * table.dim * 4)}
        embedding = facts.embedding_parameters
        estimate = Estimate(
            memory={"embedding_params": MemoryRow(PARAMETERS, embedding * 4 / n),
                    "embedding_grads": MemoryRow(GRADIENTS, 0),
                    "embedding_optimizer": MemoryRow(OPTIMIZER_STATE, rows * state_per_row / n)},
            communication={"embedding": sum(t["comm_bytes_per_rank_per_step"]
                                            for t in tables.values())},
            tables=tables)
        return estimate if layout is None else two_d.with_replica_sync(estimate, layout)

    def step_runner(self, stream: TrainStream, *, model: nn.Module, schema: FeatureSchema,
                    ctx: ParallelContext, options: TorchRecOptions) -> StepRunner:
        """``pipeline = "none"``: one step at a time; otherwise the steps run through TorchRec's
        train pipeline of that name (:mod:`gem_parallel.torchrec.pipeline`)."""
        opts = options
        if opts.pipeline == "none":
            return super().step_runner(stream, model=model, schema=schema, ctx=ctx,
                                       options=options)
        from gem_parallel.torchrec.pipeline import PipelinedSteps

        self.pipeline = PipelinedSteps(stream, model.embeddings, schema=schema, ctx=ctx,
                                       kind=opts.pipeline, options=opts)
        return self.pipeline

    def summary(self) -> dict[str, Any]:
        """The plan per table and the sparse optimizer, for ``summary.json``."""
        if self.options is None:
            return {}
        return {"plan": self.plan,
                "sparse_optimizer": {"name": self.options.optimizer, "lr": self.options.lr,
                                     "lr_schedule": self.options.lr_schedule,
                                     "fused_in_backward": True},
                # Measured: bytes of every rank's shards (weights, fused-optimizer state).
                "shard_bytes_per_rank": self.shard_bytes,
                **({} if self.layout is None else
                   {"sparse_layout": two_d.run_report(self.layout,
                                                            self._collection._replicas)}),
                **({} if self.pipeline is None else {"pipeline": self.pipeline.summary()})}
