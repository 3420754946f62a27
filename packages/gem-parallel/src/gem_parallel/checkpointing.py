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

from gem_core.config import structure
from gem_core.config.validators import choice, each
from gem_core.distributed import ParallelContext
from gem_core.errors import GemConfigError
from gem_core.precision import reject_options

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


def tower_blocks(model: nn.Module, policy: str) -> list[nn.Module]:
    blocks = getattr(getattr(model, "tower", None), "blocks", None)
    if blocks is None:
        raise RuntimeError(f"activation_checkpointing {policy!r} checkpoints model.tower.blocks; "
                           f"{type(model).__name__} has none")
    return list(blocks)


class FullCheckpointing:
    """``full``: every sequence-tower block, and every cross-attention layer between them, is
    recomputed whole."""

    def apply(self, model: nn.Module, *, ctx: ParallelContext, options) -> nn.Module:
        reject_options("activation_checkpointing 'full'", options)
        for block in tower_blocks(model, "full"):
            checkpoint_module(block)
        for layer in getattr(model.tower, "cross", None) or []:
            checkpoint_module(layer)
        return model


class SelectiveCheckpointing:
    """``selective``: only the chosen parts (attention and/or MLP) of every block."""

    def apply(self, model: nn.Module, *, ctx: ParallelContext, options) -> nn.Module:
        opts = structure(SelectiveOptions, dict(options), "parallel.activation_checkpointing")
        if not opts.modules:
            raise GemConfigError("parallel.activation_checkpointing.modules is empty; name "
                                 f"some of {', '.join(KINDS)} or use the 'none' policy")
        for block in tower_blocks(model, "selective"):
            if "attention" in opts.modules:
                if isinstance(block.attention, nn.Module):
                    checkpoint_module(block.attention)
                else:
                    block.attention = CheckpointedCall(block.attention)
            if "mlp" in opts.modules:
                checkpoint_module(block.mlp)
        return model
