"""FP8 activation stash: tensors saved for backward are kept in float8 e4m3 with a scale and
restored to their dtype when the backward needs them.

It hooks chosen module kinds (a forward pre-hook enters ``saved_tensors_hooks``, a forward hook
leaves it), so it composes with activation checkpointing: a checkpointed block saves nothing,
and its recomputation in the backward passes through the same hooks.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from gem_core.contracts import require_strategy_model
from gem_core.errors import GemConfigError

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
_QUANTIZABLE = (torch.float32, torch.bfloat16, torch.float16)


@attrs.frozen
class Quantized:
    """A float8 tensor with the scale that restores it: ``data / scale``."""

    data: Tensor
    scale: Tensor
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * 4


def quantize(x: Tensor, granularity: str) -> Quantized:
    """``x`` in float8 e4m3, scaled per tensor or per row (last dim) so its max maps to 448."""
    wide = x.detach().float()
    if granularity == "row" and wide.dim() >= 2:
        amax = wide.abs().amax(dim=-1, keepdim=True)
    else:  # a 0-d or 1-d tensor has one row: its per-row scale is the per-tensor one
        amax = wide.abs().amax()
    # an all-zero row keeps scale 1 instead of dividing by zero
    scale = FP8_MAX / torch.where(amax > 0, amax, torch.ones_like(amax))
    data = (wide * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return Quantized(data=data, scale=scale, dtype=x.dtype)


def dequantize(q: Quantized) -> Tensor:
    return (q.data.float() / q.scale).to(q.dtype)


@attrs.define
class StashStats:
    """Bytes of the saved tensors the stash saw, as they came and as it stored them."""

    quantized_tensors: int = 0
    original_bytes: int = 0
    stored_bytes: int = 0
    kept_bytes: int = 0
    """Saved tensors inside hooked modules it left as they were (parameters, small, integer)."""


class ActivationStash:
    """Pack/unpack hooks for ``saved_tensors_hooks`` that store activations in FP8."""

    def __init__(self, granularity: str = "row", min_numel: int = 1024) -> None:
        self.granularity, self.min_numel = granularity, min_numel
        self.stats = StashStats()

    def pack(self, x: Tensor) -> Any:
        # Parameters are already kept by the module; copying them to FP8 would add bytes and
        # change weight gradients. Integer and already-FP8 tensors have nothing to gain.
        # Tensor subclasses (torchao's float8 tensors) carry their own encoding.
        if (isinstance(x, nn.Parameter) or type(x) is not Tensor or x.dtype not in _QUANTIZABLE
                or x.numel() < self.min_numel):
            if not isinstance(x, nn.Parameter):
                self.stats.kept_bytes += x.numel() * x.element_size()
            return x
        q = quantize(x, self.granularity)
        self.stats.quantized_tensors += 1
        self.stats.original_bytes += x.numel() * x.element_size()
        self.stats.stored_bytes += q.nbytes
        return q

    def unpack(self, packed: Any) -> Tensor:
        return dequantize(packed) if isinstance(packed, Quantized) else packed

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def install_stash(model: nn.Module, stash: ActivationStash,
                  kinds: Sequence[str]) -> list[RemovableHandle]:
    """Quantize what the model's stash points of ``kinds`` (its interface's ``stash_points``)
    save for backward; returns the hook handles."""
    points = require_strategy_model(model, "the FP8 activation stash",
                                    "stash_points").stash_points()
    missing = [kind for kind in kinds if kind not in points]
    if missing:
        raise GemConfigError(
            f"activation_modules {missing}: {type(model).__name__}.stash_points() has no such "
            f"kinds (it has {', '.join(points) or 'none'})")
    # A module of several chosen kinds is hooked once; nested chosen modules (a SwiGLU inside
    # a chosen block) each get their own hooks, the innermost packing its own tensors.
    chosen = {id(m): m for kind in kinds for m in points[kind]}
    handles: list[RemovableHandle] = []
    for module in chosen.values():
        active: list[Any] = []

        def enter(mod: nn.Module, args: Any, active: list[Any] = active) -> None:
            context = stash.hooks() if torch.is_grad_enabled() else None
            if context is not None:
                context.__enter__()
            active.append(context)

        def leave(mod: nn.Module, args: Any, output: Any, active: list[Any] = active) -> None:
            context = active.pop()
            if context is not None:
                context.__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(enter))
        # always_call: the hooks context is left even when the forward raises
        handles.append(module.register_forward_hook(leave, always_call=True))
    return handles


def count_saved_bytes() -> tuple[torch.autograd.graph.saved_tensors_hooks, dict[str, int]]:
    """Outermost hooks that count the bytes of distinct non-parameter tensors saved for backward
    (tensors an inner stash packs never reach them)."""
    seen: set[tuple[int, int, torch.dtype]] = set()
    total = {"bytes": 0}

    def pack(x: Tensor) -> Tensor:
        key = (x.untyped_storage().data_ptr(), x.untyped_storage().nbytes(), x.dtype)
        if not isinstance(x, nn.Parameter) and key not in seen:
            seen.add(key)
            total["bytes"] += x.untyped_storage().nbytes()
        return x

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x), total
