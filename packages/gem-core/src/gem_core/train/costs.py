"""What one request costs a rank: the figure the batch balancer splits global batches by."""

from __future__ import annotations

import torch

from gem_core.flops import causal_window_pairs


def sample_costs(lengths: torch.Tensor, window: int | None,
                 candidates: torch.Tensor | None = None) -> list[float]:
    """What one request costs a rank, for batch balancing: its attention pairs plus its tokens
    (linear layers) plus its candidates (the per-impression work above the towers; one when
    not given), so an empty history still costs something."""
    per_request = 1 if candidates is None else candidates.to(lengths.dtype)
    return (causal_window_pairs(lengths, window) + lengths + per_request).tolist()
