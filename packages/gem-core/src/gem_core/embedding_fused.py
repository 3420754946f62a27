"""``reference-fused``: the embedding tables in plain PyTorch, trained by a fused optimizer inside
the backward; the reference for ``fbgemm-tbe`` (gem-kernels), with the same contract and no FBGEMM.

Why: ``fbgemm-tbe``'s fused optimizer (exact row-wise Adagrad or SGD applied by the backward to
the rows a batch looked up, :class:`gem_core.config.EmbeddingOptimizerConfig`) is compiled code
with quirks of its own (see ``gem_kernels.embedding_tbe``). This backend is the same behaviour
written out in a few lines of PyTorch: an oracle its tests compare FBGEMM against, and the fused
optimizer for a machine without ``fbgemm_gpu``. It is not fast (one lookup per feature and one
update per table, like the ``reference`` backend plus the update).

- Lookups are the ``reference`` backend's (``F.embedding_bag`` for ``sum``/``mean`` tables, empty
  bags pooled to zeros; ``F.embedding`` for sequence tables), with the same initial weights (the
  module draws them by building a :class:`~gem_core.embedding.ReferenceEmbeddingCollection`, so a
  run's other parameters start the same too), and the same refusal of ids outside a table.
- The tables are not parameters: each is a buffer ``tables.<name>.weight`` (the reference
  backend's state-dict names), so the dense AdamW never holds them. Every table is looked up by
  one :class:`torch.autograd.Function` call for all its features, whose backward sums the
  gradients of duplicate ids (within a bag, across bags and across the table's features) and
  updates each row it looked up, in place, returning no gradient for the table:

  - row-wise Adagrad (FBGEMM's ``EXACT_ROWWISE_ADAGRAD``): with ``weight_decay_mode = "l2"``,
    ``g += weight_decay * w``; then ``momentum1[r] += mean(g * g)`` over the row and
    ``w -= lr * g / (sqrt(momentum1[r]) + eps)``; with ``"decoupled"``, also
    ``w -= lr * weight_decay * w`` (the row before the step; FBGEMM's
    ``w = (1 - lr * weight_decay) * w - lr * g / (sqrt(momentum1[r]) + eps)``);
  - SGD (``EXACT_SGD``): ``w -= lr * g``.

  The learning rate is read when the backward runs (``follow_learning_rate`` sets it, with
  ``lr_schedule = "dense"`` the dense schedule's factor times ``lr``).
- Row-wise Adagrad's ``momentum1`` (one value per row) is a non-persistent buffer beside each
  table (``.to(device)`` moves both), checkpointed through the sharded-module protocol
  (:mod:`gem_core.checkpoint.sharded_modules`) as ``tables.<name>.weight`` / ``momentum1``, the
  names ``fbgemm-tbe`` uses; the layout's kind is this backend's own, so a checkpoint resumes with
  the backend that wrote it.
- Consequences, as with ``fbgemm-tbe``: ``train.grad_clip`` and ``grad_norm`` cover the dense
  parameters only; a step the guard skips has already updated the rows it looked up; only
  training mode with gradients enabled updates (in ``eval()`` the lookups carry no gradient); one
  process only (:func:`gem_core.embedding.check_fused_optimizer`). The tables stay float32 (or
  float64, for exact comparisons); half precision is refused, lookups under autocast as usual.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gem_core.capabilities import MANAGED_IDS, WHO_DECLARES
from gem_core.config.model_schema import EmbeddingOptimizerConfig
from gem_core.contracts import EmbeddingBackend, LearningRateFollower, ShardedModule
from gem_core.embedding import ReferenceEmbeddingCollection
from gem_core.embedding_tables import EmbeddingTableConfig, check_ids
from gem_core.errors import GemConfigError
from gem_core.jagged import Jagged

__all__ = ["FusedEmbeddingCollection", "FusedOptimizerCheckpoints", "LAYOUT_KIND",
           "ReferenceFusedEmbeddingBackend", "rowwise_update"]

LAYOUT_KIND = "reference-fused"
"""``checkpoint_layout()["kind"]``: what a resume must agree on."""

TABLE_DTYPES = (torch.float32, torch.float64)
"""The dtypes the tables (and momenta) may have."""


def rowwise_update(weight: Tensor, momentum: Tensor | None, ids: Tensor, grads: Tensor, *,
                   options: EmbeddingOptimizerConfig, lr: float, unique: bool = False) -> None:
    """One fused step of ``options`` on ``weight`` (and ``momentum``, row-wise Adagrad's state),
    in place: ``grads[i]`` is the gradient of the row ``ids[i]``; duplicate ids are summed first
    and the rows not in ``ids`` are left as they are. ``unique=True`` says the caller's ids are
    already distinct (a dense gradient's nonzero rows), so the summing is skipped."""
    if ids.numel() == 0:
        return
    with torch.no_grad():
        if unique:
            rows, grad = ids, grads.to(weight.dtype)
        else:
            rows, inverse = torch.unique(ids, return_inverse=True)
            grad = torch.zeros(rows.numel(), weight.shape[1], dtype=weight.dtype,
                               device=weight.device).index_add_(0, inverse,
                                                                grads.to(weight.dtype))
        old = weight.index_select(0, rows)
        if options.name == "sgd":
            weight.index_copy_(0, rows, old - lr * grad)
            return
        assert momentum is not None
        decay = options.weight_decay
        if decay and options.weight_decay_mode == "l2":
            grad = grad + decay * old
        state = momentum.index_select(0, rows) + (grad * grad).mean(dim=1)
        momentum.index_copy_(0, rows, state)
        step = (lr / (state.sqrt() + options.eps))[:, None] * grad
        if decay and options.weight_decay_mode == "decoupled":
            new = (1.0 - lr * decay) * old - step
        else:
            new = old - step
        weight.index_copy_(0, rows, new)


class _FusedLookup(torch.autograd.Function):
    """All features of one table: the forward looks them up, the backward updates the table."""

    @staticmethod
    def forward(ctx: Any, placeholder: Tensor, collection: FusedEmbeddingCollection,
                name: str, features: list[Jagged]) -> tuple[Tensor, ...]:
        table = collection.tables[name]
        weight, pooling = table.weight, table.config.pooling
        ctx.collection, ctx.pooling, ctx.features = collection, pooling, features
        ctx.weight, ctx.momentum = weight, table.momentum()
        if pooling == "none":
            return tuple(F.embedding(j.values, weight) for j in features)
        return tuple(F.embedding_bag(j.values, weight, j.offsets[:-1], mode=pooling)
                     for j in features)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[None, None, None, None]:
        ids, rows = [], []
        for jagged, grad in zip(ctx.features, grads):
            if jagged.values.numel() == 0:
                continue
            ids.append(jagged.values)
            if ctx.pooling == "none":
                rows.append(grad)
                continue
            lengths = jagged.offsets.diff().to(torch.int64)
            bags = torch.repeat_interleave(torch.arange(lengths.numel(), device=grad.device),
                                           lengths)
            per_id = grad.index_select(0, bags)
            if ctx.pooling == "mean":
                per_id = per_id / lengths.index_select(0, bags).to(grad.dtype)[:, None]
            rows.append(per_id)
        if ids:
            rowwise_update(ctx.weight, ctx.momentum, torch.cat(ids), torch.cat(rows),
                           options=ctx.collection.options, lr=ctx.collection.lr)
        return None, None, None, None


class _FusedTable(nn.Module):
    """One table: the buffer ``weight`` and row-wise Adagrad's ``momentum1`` (not in the state
    dict: it is checkpointed as the fused optimizer's state)."""

    def __init__(self, config: EmbeddingTableConfig, weight: Tensor, *, adagrad: bool) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("weight", weight)
        if adagrad:
            self.register_buffer("momentum1", torch.zeros(config.num_embeddings,
                                                          dtype=weight.dtype), persistent=False)

    def momentum(self) -> Tensor | None:
        return self._buffers.get("momentum1")


class FusedOptimizerCheckpoints(ShardedModule):
    """The checkpoint side of an embedding backend with a fused optimizer (``reference-fused``,
    ``fbgemm-tbe``): no weights here (they are buffers in the model's state dict), row-wise
    Adagrad's ``momentum1`` per table as live tensors DCP writes and loads into in place, and a
    layout that a resume with another backend or optimizer is refused by. A subclass sets
    ``layout_kind`` and has ``options`` and ``momenta()``."""

    layout_kind: str
    options: EmbeddingOptimizerConfig

    def momenta(self) -> dict[str, Tensor]:
        raise NotImplementedError

    def sharded_checkpoint_state(self) -> dict[str, dict[str, Any]]:
        return {"model": {},
                "optimizer": {f"tables.{name}.weight": {"momentum1": state}
                              for name, state in self.momenta().items()}}

    def checkpoint_layout(self) -> dict[str, Any]:
        return {"kind": self.layout_kind, "optimizer": self.options.name,
                "selected_by": f"backends.embedding={self.layout_kind}"}

    def check_checkpoint_layout(self, saved: dict[str, Any]) -> None:
        if saved.get("kind") != self.layout_kind:
            raise GemConfigError(f"the checkpoint's embedding tables were saved as "
                                 f"{saved.get('kind')!r}, not by {self.layout_kind}; use --fresh")
        if saved.get("optimizer") != self.options.name:
            raise GemConfigError(
                f"the checkpoint's tables were trained by the fused {saved.get('optimizer')!r} "
                f"and this run's model.embedding_optimizer.name is {self.options.name!r}: that "
                "optimizer's state does not carry over; use --fresh")


class FusedEmbeddingCollection(nn.Module, FusedOptimizerCheckpoints, LearningRateFollower):
    """``model.embeddings`` of the ``reference-fused`` backend (see the module docstring)."""

    layout_kind = LAYOUT_KIND

    def __init__(self, tables: Sequence[EmbeddingTableConfig], init_std: float = 0.05) -> None:
        super().__init__()
        managed = [t.name for t in tables if t.managed is not None]
        if managed:
            raise GemConfigError(
                f"embedding table(s) {', '.join(managed)} have id_policy 'managed', which the "
                "reference-fused embedding backend does not remap; use an embedding backend that "
                f"declares {MANAGED_IDS} ({WHO_DECLARES})")
        options = {t.optimizer for t in tables}
        if len(options) > 1:
            raise GemConfigError("the reference-fused backend trains every table with one "
                                 f"optimizer; the tables ask for {len(options)} different ones")
        self.options: EmbeddingOptimizerConfig = (
            next(iter(options)) if options else EmbeddingOptimizerConfig())
        self.table_configs = {t.name: t for t in tables}
        self.lr = self.options.lr
        # The reference draws the initial weights (and consumes the RNG as it does).
        reference = ReferenceEmbeddingCollection(tables, init_std=init_std)
        adagrad = self.options.name == "rowwise_adagrad"
        self.tables = nn.ModuleDict({
            name: _FusedTable(config, reference.tables[name].weight.detach(), adagrad=adagrad)
            for name, config in self.table_configs.items()})

    def momenta(self) -> dict[str, Tensor]:
        """Row-wise Adagrad's sum of mean squared gradients per row, by table (the live buffers);
        empty for SGD."""
        return {name: table.momentum() for name, table in self.tables.items()
                if table.momentum() is not None}

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> nn.Module:
        """``to(device)`` and friends move weights and momenta together (both are buffers);
        half precision is refused, as ``fbgemm-tbe`` refuses it."""
        probe = fn(torch.empty(0))  # what fn does to a float32 tensor, before it is done
        if probe.dtype not in TABLE_DTYPES:
            raise GemConfigError(
                f"the reference-fused backend keeps its tables in float32 (they were asked to "
                f"become {probe.dtype}); leave the model's dtype to the precision recipe's "
                "autocast")
        return super()._apply(fn, recurse)

    # -- forward ---------------------------------------------------------------------------------

    def forward(self, features: Mapping[str, Jagged]) -> dict[str, Tensor]:
        for config in self.table_configs.values():
            for feature in config.features:
                check_ids(features[feature].values, config, feature)
        out: dict[str, Tensor] = {}
        # A backward is an update here: in evaluation mode the lookups carry no gradient to the
        # tables, so a backward outside training (FP8 calibration, probes) changes nothing.
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.training):
            for name, config in self.table_configs.items():
                table = self.tables[name]
                jagged = [features[f] for f in config.features]
                # The autograd graph needs an input that requires grad: a fresh empty leaf, not a
                # parameter (no optimizer ever sees it).
                placeholder = torch.empty(0, device=table.weight.device,
                                          requires_grad=torch.is_grad_enabled())
                looked_up = _FusedLookup.apply(placeholder, self, name, jagged)
                out.update(zip(config.features, looked_up))
        return out

    # -- learning rate and checkpoints -----------------------------------------------------------

    def follow_learning_rate(self, factor: float) -> float | None:
        """The learning rate of the next backward: ``lr``, or ``lr * factor`` (the dense
        schedule's factor) with ``lr_schedule = "dense"``."""
        self.lr = self.options.lr * (factor if self.options.lr_schedule == "dense" else 1.0)
        return self.lr

    def checkpoint_loaded(self) -> None:
        """Nothing to do: DCP loaded into the buffers in place."""


class ReferenceFusedEmbeddingBackend(EmbeddingBackend):
    """The ``reference-fused`` embedding backend."""

    def build(self, tables: Sequence[EmbeddingTableConfig]) -> nn.Module:
        return FusedEmbeddingCollection(tables)
