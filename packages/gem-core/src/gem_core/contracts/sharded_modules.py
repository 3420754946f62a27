"""What the trainer relies on in the modules a strategy or backend puts into the model with
state of its own, outside the dense engine: TorchRec-sharded tables and fused optimizers."""

from __future__ import annotations

import abc
from typing import Any


class LearningRateFollower(abc.ABC):
    """A module with an optimizer of its own (TorchRec's fused sparse one) that follows the
    run's learning-rate schedule: the trainer calls :meth:`follow_learning_rate` every step on
    every such module of the model."""

    @abc.abstractmethod
    def follow_learning_rate(self, factor: float) -> float | None:
        """Set its learning rate to its base rate times ``factor`` (the schedule's current
        multiplier); return the rate set, or None when it has none to report."""


class ShardedModule(abc.ABC):
    """A module of the model whose state the dense engine's state dict does not hold
    (TorchRec-sharded tables and their fused optimizer); see
    :mod:`gem_core.checkpoint.sharded_modules` for how the checkpointer stores it. Every rank calls
    these methods together."""

    @abc.abstractmethod
    def sharded_checkpoint_state(self) -> dict[str, dict[str, Any]]:
        """``{"model": {name: tensor}, "optimizer": {name: {state: tensor}}}``: live
        ``ShardedTensor``s that DCP writes shard by shard and loads into in place, resharding by
        offsets."""

    @abc.abstractmethod
    def checkpoint_layout(self) -> dict[str, Any]:
        """Plain data recorded in ``trainer.json`` (``sharded_modules``)."""

    @abc.abstractmethod
    def check_checkpoint_layout(self, saved: dict[str, Any]) -> None:
        """Raise ``GemConfigError`` when the saved layout's state cannot continue in this one
        (checked before anything loads)."""

    @abc.abstractmethod
    def checkpoint_loaded(self) -> None:
        """Called after loading."""
