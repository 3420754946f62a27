"""What a dense sharding strategy hands the trainer: the model plus how to step it."""

from __future__ import annotations

from typing import Any, Callable, Collection

import torch
from torch import nn

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]
"""Builds the optimizer for a (wrapped or sharded) module; strategies call it after wrapping."""


def clipped_parameters(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The parameters with gradients that ``train.grad_clip`` clips and ``grad_norm`` measures:
    all but those of the optimizer's groups marked ``per_impression`` (``model.id_bias``'s
    offsets, :func:`gem_core.train.table_optimizer.id_bias_group`), whose step is set per
    impression and must not shrink when the rest of the model's gradients are large."""
    own_step = {id(p) for group in optimizer.param_groups if group.get("per_impression")
                for p in group["params"]}
    return [p for p in model.parameters() if p.grad is not None and id(p) not in own_step]


class Engine:
    """Forward, backward and optimizer step of a (possibly wrapped or sharded) model.

    Strategies that own the optimizer step themselves (DeepSpeed) subclass this and override
    ``backward``, ``step`` and the state-dict methods.

    Checkpoints: with ``distributed_checkpoint`` True (the default) the trainer saves and loads
    ``sharded_state_dict()`` through torch.distributed.checkpoint (DCP): every rank writes only
    its own shards, no rank gathers the full model, and a checkpoint written by any dense
    strategy and number of ranks loads into any other DCP engine (keys are the unwrapped
    model's parameter names). Engines whose state DCP cannot describe set it False and keep the
    full-state path, ``state_dict()``/``load_state_dict()``, written by rank 0; such checkpoints
    load only into the same strategy and number of ranks.
    """

    distributed_checkpoint: bool = True
    """Whether checkpoints hold this engine through ``sharded_state_dict`` and DCP (see above)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 unwrapped: nn.Module | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.unwrapped = unwrapped if unwrapped is not None else model
        """The model without wrappers: for FLOP counting and state dicts."""

    def __call__(self, batch: Any) -> Any:
        return self.model(batch)

    def predict(self, batch: Any) -> Any:
        """Forward for evaluation (no gradients). Ranks may see different numbers of eval
        batches, so this must not run collectives; wrappers that do override it."""
        return self.model(batch)

    def train(self, mode: bool = True) -> None:
        """Switch between training and evaluation. The trainer calls it on every rank
        together, so an engine may run collectives here (e.g. to gather an unsharded copy for
        evaluation); ``predict`` must not."""
        self.model.train(mode)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip to ``max_norm`` (0: only measure) and return the global gradient norm, over
        :func:`clipped_parameters`."""
        params = clipped_parameters(self.model, self.optimizer)
        if max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        return torch.nn.utils.get_total_norm([p.grad for p in params])

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def sharded_state_dict(self) -> dict[str, Any]:
        """``{"model": ..., "optimizer": ...}`` for DCP: on every rank, that rank's part (the
        whole tensors when unsharded, DTensor shards under FSDP2), keyed by the unwrapped
        model's parameter names through ``torch.distributed.checkpoint.state_dict``. The
        tensors are the live ones, so DCP can load into them in place; with a fresh optimizer
        its state is first created by a zero-learning-rate step (weights unchanged). Every rank
        calls it (collectives for sharded engines)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer}

    def load_sharded_state_dict(self, state: dict[str, Any], *,
                                stateless: Collection[str] = ()) -> None:
        """Apply a ``sharded_state_dict()`` that DCP has filled from a checkpoint. Every rank
        calls it.

        ``stateless``: parameters (by name) the checkpoint holds no optimizer state for, whose
        entries the caller has taken out of ``state["optimizer"]["state"]``. AdamW creates a
        parameter's state at its first gradient, so a parameter that had none when the
        checkpoint was written (a table no batch looked up yet) had none; it stays without
        state here, as in the run that wrote the checkpoint, so its first update is the same."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        # What set_state_dict does, in its order, with a non-strict optimizer only when
        # parameters are meant to be left without state (strict refuses any missing entry).
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"],
                                 options=StateDictOptions(strict=not stateless))
        set_model_state_dict(self.model, state["model"])

    def state_dict(self) -> dict[str, Any]:
        """Full (unsharded) model and optimizer state, meaningful on rank 0: the checkpoint
        format of engines with ``distributed_checkpoint = False``."""
        return {"model": self.unwrapped.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.unwrapped.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def summary(self) -> dict[str, Any]:
        """Written to ``summary.json`` under ``dense_sharding`` (e.g. expert parallelism's
        all-to-all bytes per step); nothing by default."""
        return {}


def local_cpu_copy(value: Any) -> Any:
    """A nested state (dicts, lists, tuples of tensors and plain values) with every tensor
    detached and copied to the CPU; a DTensor becomes this rank's local shard. For gathering
    per-rank optimizer states with ``all_gather_object``."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local().detach().cpu()
    if torch.is_tensor(value):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: local_cpu_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(local_cpu_copy(v) for v in value)
    return value


def scale_to_max_norm(params: Any, max_norm: float, total_norm: float) -> None:
    """Clip gradients whose global norm ``total_norm`` was computed by the caller (over shards,
    expert groups, ...) as ``torch.nn.utils.clip_grad_norm_`` would: one gradient at a time, so
    DTensor gradients are scaled by a plain number."""
    if max_norm <= 0:
        return
    coefficient = min(max_norm / (float(total_norm) + 1e-6), 1.0)
    if coefficient < 1.0:
        for param in params:
            param.grad.mul_(coefficient)
