"""How a run computes (kind ``precision``): the first of the strategies ``parallelize()``
applies, before embedding sharding, activation checkpointing and dense sharding.

Every ``options`` argument below is the recipe's options, typed, as the strategies' are
(:mod:`gem_core.contracts.strategies`): core structures ``[precision.options]``
(:attr:`gem_core.kinds.Kind.options_key`) once, into the attrs class the registration declares
(``ImplementationSpec.options``), refusing unknown keys and bad values by their full key
(``precision.options.foo``), and hands the same instance to every method; None for a recipe that
declares no options class (any key in the table was refused)."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Sequence

if TYPE_CHECKING:
    from torch import Tensor, nn


class PrecisionRecipe(abc.ABC):
    """How a run computes (kind ``precision``). Master weights, loss and metrics stay in float32.

    The required part is ``convert``, ``autocast`` and ``mixed_precision_policy``. A recipe that
    chooses by measuring (automatic FP8 selection) asks for calibration batches
    (:meth:`calibration_batches_for`) and overrides :meth:`calibrate`.
    """

    name: str = ""
    """The registered name, for messages."""

    compute_dtype: str = "float32"
    """The dtype its matmuls run in (``float32``, ``bfloat16``, ``float8``...), for reports."""

    calibration_batches: int = 0
    """Training batches :meth:`calibrate` needs (the default of :meth:`calibration_batches_for`)."""

    @abc.abstractmethod
    def convert(self, model: nn.Module, ctx: Any, options: Any) -> nn.Module:
        """Swap modules (e.g. FP8 linears); runs first in ``parallelize()``. ``options``:
        ``[precision.options]``, typed or None (module docstring)."""

    @abc.abstractmethod
    def autocast(self, device_type: str) -> ContextManager[None]:
        """Context around forward and loss."""

    @abc.abstractmethod
    def mixed_precision_policy(self) -> Any:
        """For sharding strategies that cast parameters themselves (FSDP2); None for none."""

    def calibration_batches_for(self, options: Any) -> int:
        """How many training batches :meth:`calibrate` gets with these ``options`` (typed or
        None; 0: none, and no calibration)."""
        return self.calibration_batches

    def calibrate(self, model: nn.Module, batches: Sequence[Any],
                  loss_fn: Callable[[Any, Any], Tensor], options: Any) -> Any:
        """Called once before ``convert`` with :meth:`calibration_batches_for` training batches
        from a separate stream (the training stream itself is not advanced), and the same
        ``options`` instance ``convert`` then gets. The default
        accepts only no batches: a recipe that asks for batches must say what it does with
        them."""
        if batches:
            raise NotImplementedError(
                f"precision recipe {self.name or type(self).__name__!r} asks for "
                f"{len(batches)} calibration batches but does not override calibrate()")
        return None

    def after_optimizer_step(self, model: nn.Module) -> None:
        """After every optimizer step taken (e.g. FP8 scales for FSDP2's FP8 all-gather)."""
        return None  # default: a recipe without per-step work does nothing

    def summary(self) -> dict[str, Any]:
        """Written to ``summary.json`` under ``precision`` (e.g. the layers converted)."""
        return {}
