"""FLOP counting from the real jagged lengths, and the padded-to-max count for comparison.

Counts are of multiply-adds x 2 in the forward pass; training is counted as 3 x forward (the
backward computes two products per forward product). Embedding lookups and elementwise work are
memory-bound and not counted, as is usual for MFU.
"""

from __future__ import annotations

import torch
from torch import Tensor

TRAIN_FACTOR = 3


def causal_window_pairs(lengths: Tensor, window: int | None) -> Tensor:
    """(query, key) pairs of causal self-attention where each token sees itself and at most
    ``window`` earlier tokens, per sample (int64). Closed form of the mask in attention.masks."""
    n = lengths.to(torch.int64)
    full = n * (n + 1) // 2
    if window is None:
        return full
    head = int(window) + 1  # keys a token sees once its past is longer than the window
    capped = head * (head + 1) // 2 + (n - head) * head
    return torch.where(n <= head, full, capped)


def attention_flops(pairs: int | Tensor, head_dim_total: int) -> Tensor | int:
    """QK^T and PV over ``pairs`` (query, key) pairs with all heads together."""
    return 4 * pairs * head_dim_total


def linear_layer_flops(module: torch.nn.Module, rows: int) -> int:
    """Forward FLOPs of every ``nn.Linear`` inside ``module`` applied to ``rows`` rows each."""
    return sum(2 * rows * m.in_features * m.out_features
               for m in module.modules() if isinstance(m, torch.nn.Linear))


def self_attention_pairs(lengths: Tensor, causal: bool, window: int | None, dense: bool) -> int:
    """(query, key) pairs of jagged self-attention. ``dense``: what a kernel that computes every
    sample's full ``L x L`` square spends (the reference backend); otherwise the masked pairs."""
    n = lengths.to(torch.int64)
    if dense or not causal:
        if not dense and window is not None:
            raise NotImplementedError("non-causal windowed attention has no closed form here")
        return int((n * n).sum())
    return int(causal_window_pairs(n, window).sum())


def cross_pairs(q_lengths: Tensor | int, kv_lengths: Tensor | int) -> int:
    """(query, key) pairs of cross-attention or PMA: every query sees every key of its sample."""
    return int(torch.as_tensor(q_lengths * kv_lengths).sum())


def sample_costs(lengths: Tensor, window: int | None,
                 candidates: Tensor | None = None) -> list[float]:
    """What one request costs a rank, the figure the batch balancer splits global batches by:
    its attention pairs plus its tokens (linear layers) plus its candidates (the per-impression
    work above the towers; one when not given), so an empty history still costs something."""
    per_request = 1 if candidates is None else candidates.to(lengths.dtype)
    return (causal_window_pairs(lengths, window) + lengths + per_request).tolist()
