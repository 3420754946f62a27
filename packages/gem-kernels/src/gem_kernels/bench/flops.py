"""Counted attention FLOPs: the pairs a jagged kernel computes versus what padding computes.

The conventions are gem-core's (:mod:`gem_core.flops`): forward is ``Q K^T`` and ``P V``, 2 FLOPs
per multiply-add, ``4 * heads * head_dim`` per (query, key) pair; training is 3 x forward.
Softmax/SiLU elementwise work is not counted (it is not matmul work).
"""

from __future__ import annotations

import torch

from gem_core.attention.api import AttentionParams
from gem_core.attention.masks import count_visible_keys
from gem_core.flops import TRAIN_FACTOR, attention_flops
from gem_core.flops import causal_window_pairs as _causal_window_pairs


def pair_flops(pairs: int, heads: int, head_dim: int) -> int:
    """Forward+backward FLOPs of ``pairs`` (query, key) pairs."""
    return int(TRAIN_FACTOR * attention_flops(pairs, heads * head_dim))


def causal_window_pairs(length: int, window: int | None) -> int:
    """Visible pairs of one causal sequence with an optional window (closed form, no mask)."""
    return int(_causal_window_pairs(torch.tensor([length]), window)[0])


def jagged_pairs(q_lengths: list[int], kv_lengths: list[int], params: AttentionParams,
                 is_self: bool) -> int:
    """The (query, key) pairs that are visible: what a jagged, block-skipping kernel needs."""
    if not is_self:
        return sum(a * b for a, b in zip(q_lengths, kv_lengths))
    if params.causal and params.num_prefix == 0:
        return int(_causal_window_pairs(torch.tensor(q_lengths), params.window).sum())
    return sum(count_visible_keys(n, 0, params) for n in q_lengths)


def padded_pairs(q_lengths: list[int], kv_lengths: list[int]) -> int:
    """Pairs computed after padding every sample to the batch maximum (masked SDPA)."""
    return len(q_lengths) * max(q_lengths, default=0) * max(kv_lengths, default=0)


def min_bytes_fwd_bwd(q_tokens: int, kv_tokens: int, heads: int, head_dim: int,
                      element_size: int) -> int:
    """Bytes a fused kernel must move at least: forward reads q, k, v and writes o; backward reads
    q, k, v, o, dO and writes dq, dk, dv. What PMA and cross-attention are judged by."""
    return 6 * (q_tokens + kv_tokens) * heads * head_dim * element_size
