"""``fbgemm-tbe``: the embedding tables on FBGEMM's table-batched embedding (TBE) operators,
trained by TBE's fused optimizer inside the backward.

- Pooled tables (``sum``/``mean``) are looked up by ``SplitTableBatchedEmbeddingBagsCodegen``
  with that pooling, all features of a pooling mode in one call; unpooled (sequence) tables by the
  same operator with ``PoolingMode.NONE`` (its sequence variant), one call per width. The outputs
  are the reference backend's (:mod:`gem_core.embedding`), with the same initial weights (the
  module draws them as the reference does, so a run's other parameters start the same too).
- The optimizer is ``[model.embedding_optimizer]``
  (:class:`gem_core.config.EmbeddingOptimizerConfig`): exact row-wise Adagrad or SGD, applied
  by TBE's backward to the rows the batch looked up (duplicate ids summed first). The tables are not
  parameters of the model: TBE lives outside the module tree, so the dense AdamW never holds them
  and no gradient reaches them twice; each table appears as a buffer ``tables.<name>.weight``, a
  view of TBE's weights, so the model's state dict has the reference backend's names
  (``gem_core.trained_run.load_run`` reads a run into either backend, and DCP loads checkpoints into
  TBE in place). The optimizer state (row-wise Adagrad's ``momentum1``, one value per row) is
  checkpointed through the sharded-module protocol (:mod:`gem_core.checkpoint.sharded_modules`) as
  ``optimizer.state.embeddings.tables.<name>.weight.momentum1``, TorchRec's names.
- Consequences (as with TorchRec's fused tables): ``train.grad_clip`` and ``grad_norm`` cover
  the dense parameters only; a step the guard skips has already updated the rows it looked up;
  only training mode updates (in ``eval()`` the lookups carry no gradient: FP8 calibration's
  backward passes, which run in evaluation mode, leave the tables as they are);
  one process only (replicas on several ranks would each apply their own gradients), which
  :func:`gem_core.embedding.check_fused_optimizer` enforces at start-up.

FBGEMM 1.8's CPU kernels, measured here: row-wise Adagrad fails ("num of rows processed by
adagrad ... does not match c_block size") unless the features are ordered by table, so they are;
with pooling, its weight decay reaches only tables that two or more features look up (a table
with one feature gets none; sequence tables are not affected), so with ``weight_decay > 0`` each
pooled table with one feature gets a second one whose bags are always empty (it adds no vector
and no gradient).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import attrs
import torch
from torch import Tensor, nn

from gem_core.capabilities import MANAGED_IDS, WHO_DECLARES
from gem_core.config import EmbeddingOptimizerConfig
from gem_core.contracts import EmbeddingBackend, LearningRateFollower
from gem_core.embedding import EmbeddingTableConfig, ReferenceEmbeddingCollection, check_ids
from gem_core.embedding_fused import FusedOptimizerCheckpoints
from gem_core.errors import GemConfigError
from gem_core.jagged import Jagged

LAYOUT_KIND = "fbgemm-tbe"
"""``checkpoint_layout()["kind"]``: what a resume must agree on."""


@attrs.frozen(kw_only=True)
class TableGroup:
    """Tables looked up by one TBE operator."""

    pooling: str
    """``sum``, ``mean`` or ``none`` (sequence lookups)."""

    tables: tuple[str, ...]
    """Table names in the operator's order."""

    features: tuple[tuple[str | None, int], ...]
    """``(feature, index of its table in tables)``, ordered by table (FBGEMM's CPU row-wise
    Adagrad needs a non-decreasing feature-to-table map); ``None``: a feature whose bags are
    always empty (see the module docstring)."""


def plan_groups(tables: Sequence[EmbeddingTableConfig], *,
                weight_decay: bool) -> list[TableGroup]:
    """One operator per pooling mode, and per width for sequence tables (whose outputs are one
    ``(ids, dim)`` matrix). With ``weight_decay``, pooled tables get at least two features."""
    keyed: dict[tuple[str, int], list[EmbeddingTableConfig]] = {}
    for table in tables:
        keyed.setdefault((table.pooling, table.dim if table.pooling == "none" else 0),
                         []).append(table)
    groups = []
    for (pooling, _), members in keyed.items():
        features: list[tuple[str | None, int]] = []
        for index, table in enumerate(members):
            features += [(feature, index) for feature in table.features]
            if weight_decay and pooling != "none" and len(table.features) == 1:
                features.append((None, index))
        groups.append(TableGroup(pooling=pooling, tables=tuple(t.name for t in members),
                                 features=tuple(features)))
    return groups


def _tbe_modules() -> dict[str, Any]:
    """FBGEMM's classes, imported when a module is built (the plugin registers lazily)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        BoundsCheckMode,
        EmbeddingLocation,
        PoolingMode,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
        WeightDecayMode,
    )

    return dict(EmbOptimType=EmbOptimType, BoundsCheckMode=BoundsCheckMode,
                EmbeddingLocation=EmbeddingLocation, PoolingMode=PoolingMode,
                ComputeDevice=ComputeDevice, WeightDecayMode=WeightDecayMode,
                TBE=SplitTableBatchedEmbeddingBagsCodegen)


def _optimizer_kwargs(options: EmbeddingOptimizerConfig, fb: Mapping[str, Any]) -> dict[str, Any]:
    if options.name == "sgd":
        return {"optimizer": fb["EmbOptimType"].EXACT_SGD, "learning_rate": options.lr}
    mode = (fb["WeightDecayMode"].NONE if not options.weight_decay else
            fb["WeightDecayMode"].L2 if options.weight_decay_mode == "l2" else
            fb["WeightDecayMode"].DECOUPLE)
    return {"optimizer": fb["EmbOptimType"].EXACT_ROWWISE_ADAGRAD, "learning_rate": options.lr,
            "eps": options.eps, "weight_decay": options.weight_decay,
            "weight_decay_mode": mode}


class TbeEmbeddingCollection(nn.Module, FusedOptimizerCheckpoints, LearningRateFollower):
    """``model.embeddings`` of the ``fbgemm-tbe`` backend (see the module docstring)."""

    layout_kind = LAYOUT_KIND

    def __init__(self, tables: Sequence[EmbeddingTableConfig], init_std: float = 0.05) -> None:
        super().__init__()
        managed = [t.name for t in tables if t.managed is not None]
        if managed:
            raise GemConfigError(
                f"embedding table(s) {', '.join(managed)} have id_policy 'managed', which the "
                "fbgemm-tbe embedding backend does not remap; use an embedding backend that "
                f"declares {MANAGED_IDS} ({WHO_DECLARES})")
        options = {t.optimizer for t in tables}
        if len(options) > 1:
            raise GemConfigError("the fbgemm-tbe backend trains every table with one optimizer; "
                                 f"the tables ask for {len(options)} different ones")
        self.options: EmbeddingOptimizerConfig = (
            next(iter(options)) if options else EmbeddingOptimizerConfig())
        self.table_configs = {t.name: t for t in tables}
        self.groups = plan_groups(tables, weight_decay=self.options.weight_decay > 0)
        self._lr = self.options.lr
        # The reference draws the initial weights (and consumes the RNG as it does).
        reference = ReferenceEmbeddingCollection(tables, init_std=init_std)
        self.tables = nn.ModuleDict({name: nn.Module() for name in self.table_configs})
        self.__dict__["_operators"] = []  # TBE modules, deliberately outside the module tree
        self._device = torch.device("cpu")
        self._build(self._device, {n: reference.tables[n].weight.detach()
                                   for n in self.table_configs}, momenta=None)

    # -- the operators ---------------------------------------------------------------------------

    def _build(self, device: torch.device, weights: Mapping[str, Tensor],
               momenta: Mapping[str, Tensor] | None) -> None:
        """(Re)create the operators on ``device`` with these weights (and optimizer state), and
        point the ``tables.<name>.weight`` buffers at their weights."""
        fb = _tbe_modules()
        on_cpu = device.type == "cpu"
        location = fb["EmbeddingLocation"].HOST if on_cpu else fb["EmbeddingLocation"].DEVICE
        compute = fb["ComputeDevice"].CPU if on_cpu else fb["ComputeDevice"].CUDA
        operators = []
        for group in self.groups:
            configs = [self.table_configs[name] for name in group.tables]
            operator = fb["TBE"](
                embedding_specs=[(c.num_embeddings, c.dim, location, compute) for c in configs],
                feature_table_map=[index for _, index in group.features],
                pooling_mode={"sum": fb["PoolingMode"].SUM, "mean": fb["PoolingMode"].MEAN,
                              "none": fb["PoolingMode"].NONE}[group.pooling],
                # Ids are checked before every lookup (check_ids: the reference's error).
                bounds_check_mode=fb["BoundsCheckMode"].NONE,
                device=device, **_optimizer_kwargs(self.options, fb))
            with torch.no_grad():
                for name, view in zip(group.tables, operator.split_embedding_weights()):
                    view.copy_(weights[name])
                    # Detached views of TBE's weights: the model's state dict reads them and
                    # loading a state dict (or a DCP checkpoint) writes into TBE in place.
                    self.tables[name].register_buffer("weight", view.detach())
                if momenta is not None:
                    for name, state in zip(group.tables, self._states_of(operator)):
                        state.copy_(momenta[name])
            if self._lr != self.options.lr:  # a rebuild keeps the schedule's current rate
                operator.set_learning_rate(self._lr)
            operators.append(operator)
        self.__dict__["_operators"] = operators
        self._device = device

    def _states_of(self, operator: Any) -> list[Tensor]:
        """Row-wise Adagrad's ``momentum1`` per table of ``operator`` (detached views); SGD has
        none."""
        if self.options.name == "sgd":
            return []
        return [states[0].detach() for states in operator.split_optimizer_states()]

    def momenta(self) -> dict[str, Tensor]:
        """Row-wise Adagrad's sum of squared gradients per row, by table (live views)."""
        return {name: state for group, operator in zip(self.groups, self._operators)
                for name, state in zip(group.tables, self._states_of(operator))}

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> nn.Module:
        """``to(device)`` and friends: the buffers move with ``fn``; the operators are rebuilt on
        the new device from them (TBE's CPU and CUDA operators are different objects)."""
        probe = fn(torch.empty(0, device=self._device))  # what fn does, before it is done
        if probe.dtype != torch.float32:
            raise GemConfigError(
                f"the fbgemm-tbe backend keeps its tables in float32 (they were asked to become "
                f"{probe.dtype}); leave the model's dtype to the precision recipe's autocast")
        momenta = {name: state.clone() for name, state in self.momenta().items()}
        views = {name: self.tables[name].weight for name in self.table_configs}
        super()._apply(fn, recurse)
        moved = {name: self.tables[name].weight for name in self.table_configs}
        device = probe.device
        if device != self._device:
            self._build(device, moved, {n: m.to(device) for n, m in momenta.items()})
            return self
        with torch.no_grad():  # same device: keep the views, with whatever fn gave
            for name, tensor in moved.items():
                if tensor is not views[name]:
                    views[name].copy_(tensor)
                    self.tables[name].register_buffer("weight", views[name])
        return self

    # -- forward ---------------------------------------------------------------------------------

    def forward(self, features: Mapping[str, Jagged]) -> dict[str, Tensor]:
        for config in self.table_configs.values():
            for feature in config.features:
                check_ids(features[feature].values, config, feature)
        out: dict[str, Tensor] = {}
        # A backward is an update here: in evaluation mode the lookups carry no gradient to the
        # tables, so a backward outside training (FP8 calibration, probes) changes nothing.
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.training):
            for group, operator in zip(self.groups, self._operators):
                if group.pooling == "none":
                    out.update(self._sequences(group, operator, features))
                else:
                    out.update(self._bags(group, operator, features))
        return out

    def _sequences(self, group: TableGroup, operator: Any,
                   features: Mapping[str, Jagged]) -> dict[str, Tensor]:
        """One vector per id: each feature is one bag of the call, its rows come out in order."""
        values = [features[f].values.to(torch.int64) for f, _ in group.features]
        counts = [v.numel() for v in values]
        offsets = torch.tensor([0] + counts, dtype=torch.int64).cumsum(0).to(self._device)
        rows = operator(torch.cat(values), offsets)
        return dict(zip((f for f, _ in group.features), rows.split(counts)))

    def _bags(self, group: TableGroup, operator: Any,
              features: Mapping[str, Jagged]) -> dict[str, Tensor]:
        """One vector per bag. TBE takes the same number of bags per feature: a feature with
        fewer gets empty bags appended (pooled to zeros), dropped from its output."""
        empty = Jagged(torch.zeros(0, dtype=torch.int64, device=self._device),
                       torch.zeros(1, dtype=torch.int64, device=self._device))
        jagged = [features[f] if f is not None else empty for f, _ in group.features]
        bags = [j.offsets.numel() - 1 for j in jagged]
        batch = max(bags)
        starts, base = [], 0
        for j, count in zip(jagged, bags):
            offsets = j.offsets.to(torch.int64) + base
            padding = offsets[-1:].expand(batch - count)
            starts.append(torch.cat([offsets[:-1], padding]))
            base += j.values.numel()
        starts.append(torch.tensor([base], dtype=torch.int64, device=self._device))
        pooled = operator(torch.cat([j.values.to(torch.int64) for j in jagged]),
                          torch.cat(starts))
        dims = [self.table_configs[group.tables[index]].dim for _, index in group.features]
        return {feature: part[:count] for (feature, _), part, count
                in zip(group.features, pooled.split(dims, dim=1), bags) if feature is not None}

    # -- learning rate and checkpoints -----------------------------------------------------------

    def follow_learning_rate(self, factor: float) -> float | None:
        """The learning rate of the next backward: ``lr``, or ``lr * factor`` (the dense
        schedule's factor) with ``lr_schedule = "dense"``."""
        lr = self.options.lr * (factor if self.options.lr_schedule == "dense" else 1.0)
        if lr != self._lr:
            for operator in self._operators:
                operator.set_learning_rate(lr)
            self._lr = lr
        return lr

    def checkpoint_loaded(self) -> None:
        """Nothing to do: DCP loaded into views of the operators' own tensors."""


class FbgemmTbeEmbeddingBackend(EmbeddingBackend):
    """The ``fbgemm-tbe`` embedding backend."""

    def build(self, tables: Sequence[EmbeddingTableConfig]) -> nn.Module:
        return TbeEmbeddingCollection(tables)
