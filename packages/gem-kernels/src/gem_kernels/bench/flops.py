"""Counted attention FLOPs: the pairs a jagged kernel computes versus what padding computes.

Forward is two matmuls (``Q K^T`` and ``P V``), 2 FLOPs per multiply-add each: ``4 * d`` per
(query, key) pair and head. Backward is four (``dV``, ``dP``, ``dQ``, ``dK``): twice the forward.
Softmax/SiLU elementwise work is not counted (it is not matmul work).
"""

from __future__ import annotations

from gem_core.attention.api import AttentionParams
from gem_core.attention.masks import count_visible_keys

FWD_BWD_MATMULS = 6


def pair_flops(pairs: int, heads: int, head_dim: int) -> int:
    """Forward+backward FLOPs of ``pairs`` (query, key) pairs."""
    return FWD_BWD_MATMULS * 2 * pairs * heads * head_dim


def causal_window_pairs(length: int, window: int | None) -> int:
    """Visible pairs of one causal sequence with an optional window (closed form, no mask)."""
    if window is None or window >= length:
        return length * (length + 1) // 2
    # Query i sees min(i, window) + 1 keys.
    full = window + 1
    return full * (full + 1) // 2 + (length - full) * full


def jagged_pairs(q_lengths: list[int], kv_lengths: list[int], params: AttentionParams,
                 is_self: bool) -> int:
    """The (query, key) pairs that are visible: what a jagged, block-skipping kernel needs."""
    if not is_self:
        return sum(a * b for a, b in zip(q_lengths, kv_lengths))
    if params.causal and params.num_prefix == 0:
        return sum(causal_window_pairs(n, params.window) for n in q_lengths)
    return sum(count_visible_keys(n, 0, params) for n in q_lengths)


def padded_pairs(q_lengths: list[int], kv_lengths: list[int]) -> int:
    """Pairs computed after padding every sample to the batch maximum (masked SDPA)."""
    return len(q_lengths) * max(q_lengths, default=0) * max(kv_lengths, default=0)
