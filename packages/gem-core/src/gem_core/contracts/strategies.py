"""The strategies ``parallelize()`` applies after the precision recipe
(:mod:`gem_core.contracts.precision`), in this order: embedding sharding (kind
``embedding_sharding``), activation checkpointing (``activation_checkpointing``) and dense
sharding (``dense_sharding``).

Every ``options`` argument below is the strategy's options, typed: core structures the kind's
table (``[parallel.dense]``, ...; :attr:`gem_core.kinds.Kind.options_key`) once, into the
attrs class the registration declares (``ImplementationSpec.options``), refusing unknown keys
and bad values by their full key, and hands the same instance to every method; None for a
strategy that declares no options class (any key in its table was refused)."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Callable, Mapping

from gem_core.contracts.steps import PlainSteps

if TYPE_CHECKING:
    from torch import nn

    from gem_core.contracts.data import TrainStream
    from gem_core.contracts.precision import PrecisionRecipe
    from gem_core.contracts.steps import StepRunner
    from gem_core.distributed import ParallelContext
    from gem_core.engine import Engine
    from gem_core.plan_estimate import Estimate, PlanFacts
    from gem_core.schema import FeatureSchema


class EmbeddingSharding(abc.ABC):
    """Places the model's embedding tables across the process group (kind
    ``embedding_sharding``). It runs before activation checkpointing and dense sharding."""

    @abc.abstractmethod
    def apply(self, model: nn.Module, *, ctx: ParallelContext,
              options: Any) -> nn.Module:
        """Shard the module at ``model.embeddings``; return the model with the same forward
        semantics. ``options``: ``[parallel.embedding]``, typed (module docstring)."""

    def plan_estimate(self, facts: PlanFacts, options: Any) -> Estimate | None:
        """Memory per rank and bytes sent per step under this strategy, for ``gem plan``, from
        the facts it measured (:mod:`gem_core.plan_estimate`); ``options`` are this kind's
        ``[parallel.*]`` options, typed (module docstring). None (this default): it gives no
        estimate, and the plan says so, naming it, instead of guessing."""
        return None

    def summary(self) -> dict[str, Any]:
        """Written to ``summary.json`` under ``embedding_sharding`` (e.g. the plan per table)."""
        return {}

    def step_runner(self, stream: TrainStream, *, model: nn.Module, schema: FeatureSchema,
                    ctx: ParallelContext, options: Any) -> StepRunner:
        """How the trainer's steps get their batches from ``stream`` once ``model`` (unwrapped,
        after :meth:`apply`) is built: e.g. a pipeline that distributes the sparse inputs of the
        next batch while this one computes. ``options``: ``[parallel.embedding]``. The default
        runs each step on the stream's next batch, nothing ahead (:class:`PlainSteps`)."""
        return PlainSteps(stream)


class ActivationCheckpointing(abc.ABC):
    """Recomputes chosen activations in the backward instead of storing them (kind
    ``activation_checkpointing``). Outputs and gradients stay the same; memory and time change."""

    @abc.abstractmethod
    def apply(self, model: nn.Module, *, ctx: ParallelContext,
              options: Any) -> nn.Module:
        """Wrap the chosen submodules; ``options``: ``[parallel.activation_checkpointing]``."""

    def compiler_settings(self, options: Any) -> Mapping[str, Any]:
        """``torch._functorch.config`` settings under which the compiled step (``train.compile``)
        compiles, e.g. ``{"activation_memory_budget": 0.5}`` (the compiler then chooses what to
        recompute). Non-empty means the policy works only through the compiler: a run without
        ``train.compile`` refuses it. Empty (this default): none."""
        return {}

    def plan_estimate(self, facts: PlanFacts, options: Any) -> Estimate | None:
        """Memory per rank and bytes sent per step under this strategy, for ``gem plan``, from
        the facts it measured (:mod:`gem_core.plan_estimate`); ``options`` are this kind's
        ``[parallel.*]`` options, typed (module docstring). None (this default): it gives no
        estimate, and the plan says so, naming it, instead of guessing."""
        return None


class DenseSharding(abc.ABC):
    """Wraps or shards the model's dense parameters and returns the Engine the trainer drives
    (kind ``dense_sharding``). Gradients equal, within float tolerance, those of one process on
    the union of the ranks' batches."""

    checkpoint_classes: tuple[str, ...] = ()
    """Library classes (qualified names) that the full-state file of this strategy's engine
    (``engine.pt``, when its ``distributed_checkpoint`` is False) may hold besides tensors and
    plain data. Reading a checkpoint builds these and no other class
    (:mod:`gem_core.checkpoint.io`): a pickle can run code. Engines saved through DCP need none."""

    @abc.abstractmethod
    def apply(self, model: nn.Module, *, ctx: ParallelContext,
              make_optimizer: Callable[[nn.Module], Any], precision: PrecisionRecipe,
              options: Any) -> Engine:
        """Wrap ``model`` for ``ctx``'s process group, build the optimizer with
        ``make_optimizer(module)`` (or own it, as DeepSpeed does) and return an
        :class:`gem_core.engine.Engine` (whose ``summary()`` goes to ``summary.json`` under
        ``dense_sharding``). ``precision``'s ``mixed_precision_policy()`` is for strategies that
        cast parameters; ``options`` is ``[parallel.dense]``, typed (module docstring)."""

    def plan_estimate(self, facts: PlanFacts, options: Any) -> Estimate | None:
        """Memory per rank and bytes sent per step under this strategy, for ``gem plan``, from
        the facts it measured (:mod:`gem_core.plan_estimate`); ``options`` are this kind's
        ``[parallel.*]`` options, typed (module docstring). None (this default): it gives no
        estimate, and the plan says so, naming it, instead of guessing."""
        return None
