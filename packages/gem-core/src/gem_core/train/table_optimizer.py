"""Row-wise Adagrad (or SGD) for embedding tables that are parameters of the model, as a parameter
group of the dense optimizer (``[model.embedding_optimizer] dense_tables = "same"``).

Why: the fused backends (``fbgemm-tbe``, ``reference-fused``) update the rows a batch looked up
inside the backward, with each rank's own gradients, so they run in one process only. Row-wise
Adagrad (one accumulated squared gradient per row: a row seen in few batches takes large steps, a
frequent one small steps) is the usual optimizer of sparse tables; on MovieLens-100k it beats
AdamW for the attention presets' tables, on `order` over 3000 steps it loses (docs/results.md),
so the presets keep AdamW and this is a choice. Here the same update (the one
function :func:`gem_core.embedding_fused.rowwise_update`) runs in the optimizer step instead, after
DDP has all-reduced or FSDP2 has reduce-scattered the gradients, so every replica applies the
same update and FSDP2's shards of a table update their own rows.

- :class:`AdamWWithTables` is ``torch.optim.AdamW`` whose groups marked ``table_optimizer`` are
  stepped row-wise: AdamW never sees their gradients (they are set aside during its step).
- A row is stepped when its gradient is not all zeros: the rows a batch looked up, as the fused
  backends step them (a looked-up row whose gradient is exactly zero is the one difference, and
  only weight decay could tell). Row-wise Adagrad's state ``momentum1`` has one float per row,
  created at a parameter's first gradient (as AdamW's state is), a DTensor sharded like its
  table under FSDP2, so DCP saves and reshards it like any optimizer state; ``step`` counts the
  steps, as AdamW's does.
- The learning rate: with ``lr_schedule = "dense"`` the engine sets the group's ``lr`` to the
  schedule times ``lr_scale`` (the table rate over ``train.lr``); with ``constant`` the group's
  ``table_lr``.
- The per-id offsets of ``model.id_bias`` (:func:`id_bias_group`) are such a group too, stepped
  per impression: the loss is a mean over the step's impressions, so the group's gradient times
  the step's impressions (all ranks'), which the trainer gives it before each step
  (:func:`set_step_impressions`), is each offset's ``sum(p - y)`` over its impressions. Stepped
  either at a constant rate per impression (``constant``: ``b -= rate * sum(p - y)``) or as an
  online per-id posterior (``fisher``): each offset keeps ``F``, the sum over steps of its
  squared ``sum(p - y)`` (whose expectation is the Fisher information ``sum p (1 - p)`` of its
  impressions: the empirical Fisher), and steps ``b -= sum(p - y) / (1 / rate + F)``, a Newton
  step under a Gaussian prior of variance ``rate``. At an id's first impressions the two agree;
  an id seen often takes ever smaller steps, so it settles on its effect instead of jittering
  about it with a spread of about ``sqrt(rate / 2)`` as a constant step does. With a ``learned``
  prior, ``rate`` is only where the prior variance starts: each offsets tensor keeps it in
  ``prior`` (one per task, the same on every rank), and after each step sets it to the mean over
  the ids seen so far (``F > 0``) of ``b^2 + 1 / (1 / prior + F)``, the expectation-maximisation
  update of a Gaussian prior's variance from the offsets' posterior means and variances; under
  FSDP2 the sums are taken over every rank's rows.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

import attrs
import torch
from torch import Tensor, nn

from gem_core.capabilities import FUSED_OPTIMIZER, TABLE_OPTIMIZER, declared_by
from gem_core.config.model_schema import (
    ID_BIAS_PRIORS,
    ID_BIAS_STEPS,
    EmbeddingOptimizerConfig,
    ModelConfig,
)
from gem_core.distributed import local_part
from gem_core.embedding import SINGLE_PROCESS_EMBEDDING_SHARDING
from gem_core.embedding_fused import rowwise_update
from gem_core.errors import GemConfigError

if TYPE_CHECKING:
    from gem_core.plugins import GemPlugins
    from gem_core.registry import ImplementationSpec

__all__ = ["AdamWWithTables", "FISHER", "PRIOR", "check_id_bias_stepper", "id_bias_arguments",
           "id_bias_group", "learned_prior",
           "resolve_table_optimizer", "row_state", "set_step_impressions", "table_group"]

log = logging.getLogger(__name__)

MOMENTUM = "momentum1"
"""The state key of row-wise Adagrad's per-row sum (FBGEMM's name)."""

FISHER = "fisher"
"""The state key of the ``fisher`` offsets' summed squared per-impression gradients (one per
offset: per id and task)."""

PRIOR = "prior"
"""The state key of a ``learned`` prior's variance (one per task, replicated on every rank)."""


def table_group(params: list[nn.Parameter], options: EmbeddingOptimizerConfig,
                dense_lr: float) -> dict[str, Any]:
    """The parameter group of ``params`` (embedding tables) stepped by ``options``; plain values
    only, so the group is checkpointed with the optimizer's state dict."""
    return {"params": params, "weight_decay": 0.0, "table_optimizer": options.name,
            "table_lr": options.lr, "table_lr_schedule": options.lr_schedule,
            "table_eps": options.eps, "table_weight_decay": options.weight_decay,
            "table_weight_decay_mode": options.weight_decay_mode,
            "lr_scale": options.lr / dense_lr}


def id_bias_arguments(config: ModelConfig) -> dict[str, Any]:
    """``make_optimizer``'s ``id_bias_*`` arguments from ``[model]``: the one place the trainer
    and the benchmarks read them."""
    return {"id_bias_rate": config.id_bias_rate, "id_bias_step": config.id_bias_step,
            "id_bias_prior": config.id_bias_prior}


def id_bias_group(params: list[nn.Parameter], rate: float, step: str,
                  prior: str = "fixed") -> dict[str, Any]:
    """The parameter group of ``model.id_bias``'s offsets, stepped per impression by ``step``
    (``fisher`` or ``constant``) at ``rate``, under a ``fixed`` or ``learned`` prior (see the
    module docstring). ``impressions`` starts at 1 (a caller that does not say how many
    impressions its loss averages, such as a benchmark, steps on the mean as if it were one
    impression's)."""
    if step not in ID_BIAS_STEPS:
        raise ValueError(f"id_bias step {step!r}: one of {ID_BIAS_STEPS}")
    if prior not in ID_BIAS_PRIORS:
        raise ValueError(f"id_bias prior {prior!r}: one of {ID_BIAS_PRIORS}")
    if prior == "learned" and step != "fisher":
        raise ValueError(f"id_bias prior 'learned' reads each offset's posterior variance from "
                         f"its fisher state; the step {step!r} keeps none")
    sgd = EmbeddingOptimizerConfig(name="sgd", lr=rate, dense_tables="same")
    return {**table_group(params, sgd, dense_lr=rate), "per_impression": True,
            "impressions": 1.0, "id_bias_step": step, "id_bias_prior": prior}


def set_step_impressions(optimizer: torch.optim.Optimizer, impressions: float) -> None:
    """Tell the per-impression groups (:func:`id_bias_group`) how many impressions the mean
    loss of the coming step averages (all ranks'); the others need not know."""
    for group in optimizer.param_groups:
        if group.get("per_impression"):
            group["impressions"] = float(impressions)


def _options(group: dict[str, Any]) -> EmbeddingOptimizerConfig:
    return EmbeddingOptimizerConfig(
        name=group["table_optimizer"], lr=group["table_lr"], lr_schedule=group["table_lr_schedule"],
        eps=group["table_eps"], weight_decay=group["table_weight_decay"],
        weight_decay_mode=group["table_weight_decay_mode"], dense_tables="same")


def _new_momentum(param: Tensor) -> Tensor:
    """Zeros, one per row of ``param``, placed like its rows: for a DTensor (FSDP2's dim-0 shards,
    HSDP's replicated shards) a DTensor on the same mesh and placements, so that DCP sees each
    rank's rows of the state where it sees that rank's rows of the table."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return torch.zeros(param.shape[0], dtype=param.dtype, device=param.device)
    if any(p.is_shard() and p.dim != 0 for p in param.placements):
        raise RuntimeError(
            f"row-wise table state needs tables sharded by rows (dim 0); this one is placed "
            f"{param.placements}")
    return row_state(torch.zeros(param.to_local().shape[0], dtype=param.dtype,
                                 device=param.device), param)


def row_state(local: Tensor, param: Tensor) -> Tensor:
    """``local`` (one value per row of ``param`` that this rank holds) as a DTensor on
    ``param``'s mesh and placements, of global shape ``(rows,)``: how row-wise state is placed,
    here and where an engine loads it back from per-rank checkpoints."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                              shape=torch.Size([param.shape[0]]), stride=(1,))


class AdamWWithTables(torch.optim.AdamW):
    """AdamW, plus parameter groups built by :func:`table_group` stepped row-wise (see the module
    docstring). Without such groups it is AdamW."""

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        tables = [g for g in self.param_groups if g.get("table_optimizer")]
        set_aside = [(p, p.grad) for g in tables for p in g["params"] if p.grad is not None]
        for param, _ in set_aside:
            param.grad = None
        try:
            super().step()
        finally:
            for param, grad in set_aside:
                param.grad = grad
        for group in tables:
            self._step_tables(group)
        return loss

    def _counted_state(self, param: Tensor,
                       initial: Callable[[Tensor], dict[str, Tensor]]) -> dict[str, Any]:
        """``param``'s state with its step counted: made at its first step as a step count (as
        AdamW keeps, and its load_state_dict expects of any state) plus ``initial(param)``."""
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state.update(initial(param))
        state["step"] += 1
        return state

    def _step_offsets(self, group: dict[str, Any]) -> None:
        """``model.id_bias``'s offsets (module docstring): dense gradients, zero where an id had
        no impression in the step, so such an offset (and its ``F``) is left as it is."""
        rate, impressions = group["table_lr"], group["impressions"]
        fisher = group["id_bias_step"] == "fisher"
        # Groups written before the prior could be learned have no such key: fixed.
        learned = group.get("id_bias_prior", "fixed") == "learned"
        for param in group["params"]:
            if param.grad is None:
                continue
            # F is placed like the offsets (a DTensor under FSDP2); the prior, one per task, is
            # the same on every rank.
            state = self._counted_state(param, lambda p: {
                **({FISHER: torch.zeros_like(p)} if fisher else {}),
                **({PRIOR: torch.full(p.shape[1:], rate, dtype=p.dtype, device=p.device)}
                   if learned else {})})
            residual = local_part(param.grad) * impressions  # each offset's sum(p - y)
            offsets = local_part(param)
            if not fisher:
                offsets.sub_(rate * residual)
                continue
            information = local_part(state[FISHER])
            information.addcmul_(residual, residual)
            prior = state[PRIOR] if learned else rate
            offsets.sub_(residual / (1.0 / prior + information))
            if learned:
                state[PRIOR] = learned_prior(offsets, information, prior, param)

    def _step_tables(self, group: dict[str, Any]) -> None:
        if group.get("per_impression"):
            self._step_offsets(group)
            return
        options = _options(group)
        lr = group["lr"] if options.lr_schedule == "dense" else options.lr
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self._counted_state(param, lambda p: (
                {MOMENTUM: _new_momentum(p)} if options.name == "rowwise_adagrad" else {}))
            grad = local_part(param.grad)
            # Both ways give distinct rows: coalesce() sums a sparse gradient's duplicates.
            if grad.is_sparse:
                grad = grad.coalesce()
                rows, row_grads = grad.indices()[0], grad.values()
            else:
                rows = grad.ne(0).any(dim=1).nonzero().squeeze(1)
                row_grads = grad.index_select(0, rows)
            momentum = local_part(state[MOMENTUM]) if MOMENTUM in state else None
            rowwise_update(local_part(param), momentum, rows, row_grads, options=options, lr=lr,
                           unique=True)


def learned_prior(offsets: Tensor, information: Tensor, prior: Tensor,
                  param: Tensor) -> Tensor:
    """The prior variance per task after one expectation-maximisation update: the mean over the
    ids seen so far (``F > 0``) of ``b^2 + 1 / (1 / prior + F)``. ``offsets`` and
    ``information`` are this rank's rows of ``param`` and of its ``F``; under FSDP2 the sums
    are all-reduced over the mesh dimensions that shard the rows, so every rank gets the same
    prior. A task with no id seen keeps its prior."""
    seen = information > 0
    posterior = offsets * offsets + 1.0 / (1.0 / prior + information)
    sums = torch.stack([torch.where(seen, posterior, 0.0).sum(0),
                        seen.sum(0).to(offsets.dtype)])
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        import torch.distributed as dist

        for dim, placement in enumerate(param.placements):
            if placement.is_shard():
                dist.all_reduce(sums, group=param.device_mesh.get_group(dim))
    return torch.where(sums[1] > 0, sums[0] / sums[1].clamp(min=1), prior)


def check_id_bias_stepper(config: ModelConfig, *, dense_sharding: ImplementationSpec,
                          plugins: GemPlugins) -> None:
    """At start-up: ``model.id_bias``'s offsets are a group of the dense optimizer stepped per
    impression (:func:`id_bias_group`), so the dense sharding must step the optimizer
    that ``make_optimizer`` built, on the parameters as the module holds them; a ``learned``
    prior needs the ``fisher`` step. Logs what the run's offsets are."""
    id_bias = config.id_bias
    if not id_bias:
        return
    if TABLE_OPTIMIZER not in dense_sharding.capabilities:
        able = declared_by(plugins.registry("dense_sharding").specs(), TABLE_OPTIMIZER)
        raise GemConfigError(
            f"model.id_bias = {list(id_bias)} steps its offsets per impression in the dense "
            f"optimizer's step, which the dense sharding {dense_sharding.name!r} does not "
            f"declare ({TABLE_OPTIMIZER}: it flattens parameters into partitions of its own); "
            f"choose one that does ({able}) or leave model.id_bias empty")
    if config.id_bias_prior == "learned" and config.id_bias_step != "fisher":
        raise GemConfigError(
            f"model.id_bias_prior = 'learned' re-estimates the prior from each offset's "
            f"posterior variance, which only model.id_bias_step = 'fisher' keeps (it is "
            f"{config.id_bias_step!r}); set the step to 'fisher' or the prior to 'fixed'")
    log.info("model.id_bias: an offset per id and task of %s, stepped per impression (%s, "
             "model.id_bias_rate %g%s), not by AdamW", ", ".join(id_bias), config.id_bias_step,
             config.id_bias_rate,
             ", the prior's variance learned from it" if config.id_bias_prior == "learned"
             else "")


def resolve_table_optimizer(options: EmbeddingOptimizerConfig, *, embedding: ImplementationSpec,
                            embedding_sharding: ImplementationSpec,
                            dense_sharding: ImplementationSpec,
                            plugins: GemPlugins) -> EmbeddingOptimizerConfig:
    """At start-up: ``options`` with ``dense_tables`` decided for this run's backends, or a
    refusal. Tables that are parameters (an embedding backend without :data:`FUSED_OPTIMIZER`)
    can be stepped row-wise when the dense sharding declares :data:`TABLE_OPTIMIZER` and no
    embedding sharding replaced them with its own (their optimizer would be
    ``[parallel.embedding]``'s). ``same`` where they cannot is refused; ``auto`` becomes ``same``
    where they can and ``adamw`` where not, and the log says which and why."""
    if options.dense_tables == "adamw" or FUSED_OPTIMIZER in embedding.capabilities:
        return options
    blocker = None
    if TABLE_OPTIMIZER not in dense_sharding.capabilities:
        able = declared_by(plugins.registry("dense_sharding").specs(), TABLE_OPTIMIZER)
        blocker = (f"the dense sharding {dense_sharding.name!r} does not declare "
                   f"{TABLE_OPTIMIZER} (it flattens parameters into partitions of its own; "
                   f"those that step the tables' rows as the module holds them: {able})")
    elif embedding_sharding.name != SINGLE_PROCESS_EMBEDDING_SHARDING:
        blocker = (f"the embedding sharding {embedding_sharding.name!r} replaces the tables "
                   f"with its own tables and optimizer ([parallel.embedding] optimizer and lr; "
                   f"--embedding-sharding {SINGLE_PROCESS_EMBEDDING_SHARDING} leaves them)")
    if options.dense_tables == "same" and blocker:
        raise GemConfigError(
            f"model.embedding_optimizer.dense_tables = 'same' cannot step the feature tables "
            f"row-wise: {blocker}; choose another or dense_tables = 'adamw' (or 'auto')")
    if options.dense_tables == "auto":
        resolved = "adamw" if blocker else "same"
        log.info("model.embedding_optimizer.dense_tables = auto: %s", (
            f"adamw, because {blocker}" if blocker else
            f"same: the feature tables train with {options.name} at lr {options.lr:g} "
            f"({options.lr_schedule}) in the dense step"))
        options = attrs.evolve(options, dense_tables=resolved)
    return options
