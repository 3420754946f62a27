"""Which linear layers may run in FP8: the shape and name rules shared by every FP8 recipe."""

from __future__ import annotations

import fnmatch
from typing import Sequence

from torch import nn

from gem_core.contracts import require_strategy_model

# FP8 matmul kernels (torch._scaled_mm) need both matmul dims to be multiples of 16.
FP8_ALIGNMENT = 16


def matches(fqn: str, pattern: str) -> bool:
    """``pattern`` names ``fqn`` itself, a module above it, or matches it as an fnmatch glob."""
    return fqn == pattern or fqn.startswith(pattern + ".") or fnmatch.fnmatchcase(fqn, pattern)


def why_not_fp8(fqn: str, module: nn.Module, *, exclude: Sequence[str], min_dim: int,
                head: bool = False) -> str:
    """Empty when ``module`` may be converted, else the reason it stays in high precision
    (``head``: it is, or is inside, one of the model's ``output_heads()``)."""
    if type(module) is not nn.Linear:
        return f"not a plain nn.Linear ({type(module).__name__})"
    if head:
        # Task heads produce the logits the loss and NE read: always kept in high precision.
        return "task head"
    hit = next((p for p in exclude if matches(fqn, p)), None)
    if hit is not None:
        return f"excluded by {hit!r}"
    dims = (module.in_features, module.out_features)
    if any(d % FP8_ALIGNMENT for d in dims):
        return f"shape {dims[0]}x{dims[1]} not divisible by {FP8_ALIGNMENT}"
    if min(dims) < min_dim:
        return f"shape {dims[0]}x{dims[1]} below min_dim {min_dim}"
    return ""


def fp8_candidates(model: nn.Module, *, exclude: Sequence[str],
                   min_dim: int) -> tuple[dict[str, nn.Linear], dict[str, str]]:
    """Linear layers that may run in FP8, and every other linear layer with its reason."""
    heads = require_strategy_model(model, "the FP8 precision recipes",
                                   "output_heads").output_heads()
    in_heads = {id(m) for head in heads for m in head.modules()}
    chosen: dict[str, nn.Linear] = {}
    skipped: dict[str, str] = {}
    for fqn, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue  # embeddings, norms and activations are never FP8 candidates
        reason = why_not_fp8(fqn, module, exclude=exclude, min_dim=min_dim,
                             head=id(module) in in_heads)
        if reason:
            skipped[fqn] = reason
        else:
            chosen[fqn] = module
    return chosen, skipped
