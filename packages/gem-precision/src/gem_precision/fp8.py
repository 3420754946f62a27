"""``fp8-tensorwise`` and ``fp8-rowwise``: selective torchao float8 training of linear layers."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, ContextManager

from torch import nn

from gem_core.contracts import PrecisionRecipe
from gem_precision.activation_stash import ActivationStash, install_stash
from gem_precision.float8 import check_float8_runs, convert_layers, emulate_on, float8_config
from gem_precision.options import Fp8Options
from gem_precision.selection import fp8_candidates

log = logging.getLogger(__name__)


def model_device(model: nn.Module, ctx: Any):
    device = getattr(ctx, "device", None)
    return device if device is not None else next(model.parameters()).device


def finish_conversion(model: nn.Module, names: list[str], options: Fp8Options, recipe: str,
                      ctx: Any, owner: Any) -> nn.Module:
    """Convert ``names`` to float8 and install the activation stash when asked; records what was
    done on ``owner`` (``converted``, ``stash``)."""
    device = model_device(model, ctx)
    emulate = emulate_on(device, options.float8_matmul)
    config = float8_config(recipe, emulate=emulate,
                           fsdp_float8_all_gather=options.fsdp_float8_all_gather)
    if names:
        check_float8_runs(config, device)
    model = convert_layers(model, names, config)
    owner.converted = tuple(names)
    owner.stash = None
    if options.activation_fp8:
        owner.stash = ActivationStash(options.activation_scaling, options.activation_min_numel)
        install_stash(model, owner.stash, options.activation_modules)
    log.info("%s: %d linear layers in float8 (%s scaling, %s matmuls on %s): %s; activation "
             "stash: %s", owner.name, len(names), recipe,
             "emulated" if emulate else "scaled_mm", device.type, ", ".join(names) or "none",
             f"{options.activation_scaling}-scaled in {', '.join(options.activation_modules)}"
             if options.activation_fp8 else "off")
    return model


class Float8Recipe(PrecisionRecipe):
    """Linear layers whose shapes suit FP8 run through torchao's Float8Linear; embeddings,
    norms, task heads and excluded modules stay float32. Master weights stay float32."""

    compute_dtype = "float8"

    def __init__(self, recipe: str) -> None:
        self.recipe = recipe
        self.name = f"fp8-{recipe}"
        self.converted: tuple[str, ...] = ()
        self.skipped: dict[str, str] = {}
        self.stash: ActivationStash | None = None

    def convert(self, model: nn.Module, ctx: Any, options: Fp8Options) -> nn.Module:
        """``options``: ``[precision.options]`` as the spec's class (``Fp8Options``, or
        ``Fp8RowwiseOptions`` for rowwise scaling)."""
        chosen, self.skipped = fp8_candidates(model, exclude=options.exclude,
                                              min_dim=options.min_dim)
        return finish_conversion(model, list(chosen), options, self.recipe, ctx, self)

    def autocast(self, device_type: str) -> ContextManager[None]:
        # Unconverted layers compute in float32: the recipe's point is FP8 where it is safe and
        # full precision elsewhere, not bf16 everywhere else.
        return contextlib.nullcontext()

    def mixed_precision_policy(self) -> None:
        return None  # parameters stay float32; FP8 casts happen inside Float8Linear
