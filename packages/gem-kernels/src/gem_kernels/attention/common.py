"""Argument checks shared by the gem-kernels attention backends (no triton/fbgemm imports)."""

from __future__ import annotations

import torch
from torch import Tensor

from gem_core.attention.api import AttentionParams, needs_self_attention, validate_attention_inputs
from gem_core.attention.relative_bias import RelativeBias

# Larger than any sequence, so a huge window or prefix can be handed to int32 kernel arguments
# unchanged in meaning (one at least as long as the sequence covers all of it).
MAX_WINDOW = 2**30


def checked_inputs(
    backend: str, dtypes: tuple[torch.dtype, ...], q: Tensor, k: Tensor, v: Tensor,
    q_offsets: Tensor, kv_offsets: Tensor, params: AttentionParams, num_targets: Tensor | None,
    bias: RelativeBias | None = None,
) -> bool:
    """Validate the call like every backend must; return whether it is self-attention that
    matters (:func:`needs_self_attention`; decided without reading device values)."""
    validate_attention_inputs(q, k, v, q_offsets, kv_offsets, params, num_targets, bias)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{backend} attention needs q, k, v of one dtype, got {q.dtype}, "
                        f"{k.dtype}, {v.dtype}")
    if q.dtype not in dtypes:
        raise TypeError(f"{backend} attention does not support dtype {q.dtype}; it supports "
                        f"{', '.join(str(d) for d in dtypes)}")
    if not (q.device == k.device == v.device == q_offsets.device == kv_offsets.device):
        raise ValueError(f"{backend} attention needs every input on one device")
    return needs_self_attention(params, num_targets, bias)


def max_length(offsets: Tensor, given: int | None) -> int:
    """``given`` if the caller knows it (no device sync), else the longest row."""
    if given is not None:
        return given
    if offsets.numel() < 2:
        return 0
    return int((offsets[1:] - offsets[:-1]).max())
