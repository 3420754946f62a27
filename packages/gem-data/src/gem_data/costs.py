"""Per-sample costs of a batch, for batch balancing across data-parallel ranks.

The trainer hands a ``cost_fn`` to :meth:`DataSource.train_stream`; these are the natural ones
for GEM's sequence tower. ``tokens`` is the history length (+1 for the candidate); ``attention``
counts the query-key pairs causal self-attention over the history computes with a local window
of ``window`` earlier events (0: unlimited), which is what makes heavy-tailed histories uneven.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gem_core.batch import JaggedBatch


def attention_pairs(lengths: Tensor, window: int = 0) -> Tensor:
    """Per sample, causal attention pairs: sum over positions i of min(i + 1, window)."""
    n = lengths.to(torch.float64)
    if window <= 0:
        return n * (n + 1) / 2
    w = float(window)
    full = torch.minimum(n, torch.tensor(w, dtype=torch.float64))
    return full * (full + 1) / 2 + (n - full) * w


def token_costs(batch: JaggedBatch) -> list[float]:
    """History events + 1 (the candidate) per sample."""
    return (batch.seq_lengths().to(torch.float64) + 1).tolist()


def attention_costs(batch: JaggedBatch, window: int = 0) -> list[float]:
    """Causal self-attention pairs per sample, plus its tokens (so empty histories cost > 0)."""
    lengths = batch.seq_lengths()
    return (attention_pairs(lengths, window) + lengths.to(torch.float64) + 1).tolist()
