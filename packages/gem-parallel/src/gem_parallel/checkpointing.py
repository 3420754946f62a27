"""Activation checkpointing policies ``full`` and ``selective`` (torch.utils.checkpoint).

The chosen parts keep only their inputs in the forward and run again in the backward to rebuild
their activations: less memory, one extra forward of those parts. Parameters keep their names
(the forward is replaced on the instance, no wrapper module), so state dicts, optimizers and
FSDP2 units are unchanged; FSDP2 gathers a block's parameters again for its recomputation.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
from torch import nn
from torch.utils.checkpoint import checkpoint

from gem_core.config.validators import choice, each
from gem_core.contracts import ActivationCheckpointing, require_strategy_model
from gem_core.distributed import ParallelContext
from gem_core.errors import GemConfigError
from gem_core.plan_estimate import Estimate, PlanFacts, measured_activations

KINDS = ("attention", "mlp")


@attrs.frozen(kw_only=True)
class SelectiveOptions:
    """``[parallel.activation_checkpointing]`` of ``selective``."""

    modules: tuple[str, ...] = attrs.field(default=("attention",), converter=tuple,
                                           validator=each(choice(*KINDS)))
    """Parts of every sequence-tower block to recompute: ``attention`` (the attention kernel
    call: its scores are the activations that grow with length x window) and/or ``mlp`` (the
    SwiGLU MLP: its hidden activations are ``mlp_ratio`` x wider than a token)."""


class CheckpointedForward:
    """Stands in for ``module.forward``: the module's class forward under checkpoint.

    It holds the module, not a bound method, so ``copy.deepcopy`` of the model (evaluation
    replicas) rebinds it to the copy."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # type(...).forward, not the instance attribute (which is this object): after FSDP2
        # swaps the class, the forward is still the block's own.
        return checkpoint(type(self.module).forward, self.module, *args, use_reentrant=False,
                          **kwargs)


class CheckpointedCall:
    """A plain callable (an attention backend) under checkpoint."""

    def __init__(self, function: Callable) -> None:
        self.function = function

    def __getattr__(self, name: str) -> Any:
        # Backend attributes (``name``, capabilities) stay visible through the wrapper; dunder
        # and own names are not forwarded (copy/pickle probe them before ``function`` exists).
        if name == "function" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.function, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.function, *args, use_reentrant=False, **kwargs)


def checkpoint_module(module: nn.Module) -> None:
    if isinstance(module.__dict__.get("forward"), CheckpointedForward):
        raise RuntimeError(f"{type(module).__name__} is already checkpointed")
    module.forward = CheckpointedForward(module)


def checkpoint_parts(model: nn.Module, kind: str, policy: str) -> list[tuple[nn.Module, str]]:
    """The model's parts of ``kind`` (its interface's ``checkpoint_parts``); refused when it has
    none: the user asked for recomputation that would not happen."""
    parts = require_strategy_model(model, f"activation_checkpointing {policy!r}",
                                   "checkpoint_parts").checkpoint_parts(kind)
    if not parts:
        raise GemConfigError(f"activation_checkpointing {policy!r}: {type(model).__name__} has "
                             f"no {kind!r} parts to recompute (checkpoint_parts({kind!r}) is "
                             "empty); use the 'none' policy")
    return parts


def checkpoint_part(owner: nn.Module, attribute: str) -> None:
    """Checkpoint ``owner.<attribute>``: a module's forward in place, a plain callable (an
    attention backend) by a checkpointed stand-in."""
    part = getattr(owner, attribute)
    if isinstance(part, nn.Module):
        checkpoint_module(part)
    else:
        setattr(owner, attribute, CheckpointedCall(part))


class FullCheckpointing(ActivationCheckpointing):
    """``full``: every part the model names as a ``block`` (the GEM model: each sequence-tower
    block and each cross-attention layer between them) is recomputed whole."""

    def apply(self, model: nn.Module, *, ctx: ParallelContext, options) -> nn.Module:
        for owner, attribute in checkpoint_parts(model, "block", "full"):
            checkpoint_part(owner, attribute)
        return model

    def plan_estimate(self, facts: PlanFacts, options) -> Estimate:
        """The activations gem plan measured with this policy applied (blocks keep only their
        inputs)."""
        return measured_activations(facts)


class SelectiveCheckpointing(ActivationCheckpointing):
    """``selective``: only the chosen parts (attention and/or MLP) of every block."""

    def apply(self, model: nn.Module, *, ctx: ParallelContext,
              options: SelectiveOptions) -> nn.Module:
        if not options.modules:
            raise GemConfigError("parallel.activation_checkpointing.modules is empty; name "
                                 f"some of {', '.join(KINDS)} or use the 'none' policy")
        for kind in options.modules:
            for owner, attribute in checkpoint_parts(model, kind, "selective"):
                checkpoint_part(owner, attribute)
        return model

    def plan_estimate(self, facts: PlanFacts, options: SelectiveOptions) -> Estimate:
        """The activations gem plan measured with this policy applied."""
        return measured_activations(facts)
