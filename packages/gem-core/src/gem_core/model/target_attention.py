"""Target-aware attention: each candidate ad queries its own user's history (short q, long K/V)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gem_core.attention import AttentionBackend, AttentionParams

_FULL = AttentionParams()  # every query sees every key of its own sample


class TargetAwareAttention(nn.Module):
    """One query per sample (the candidate token) over that sample's history tokens.

    A sample with an empty history gets a zero vector (the attention API's contract), so its
    prediction rests on the other tokens.
    """

    def __init__(self, dim: int, heads: int, attention: AttentionBackend) -> None:
        super().__init__()
        self.heads, self.attention = heads, attention
        self.query = nn.Linear(dim, dim, bias=False)
        self.key_value = nn.Linear(dim, 2 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, candidate: Tensor, history: Tensor, offsets: Tensor, max_len: int) -> Tensor:
        batch, dim = candidate.shape
        head_dim = dim // self.heads
        q = self.query(candidate).view(batch, self.heads, head_dim)
        k, v = self.key_value(history).view(-1, 2, self.heads, head_dim).unbind(1)
        q_offsets = torch.arange(batch + 1, device=candidate.device, dtype=offsets.dtype)
        out = self.attention(q, k, v, q_offsets, offsets, params=_FULL, max_q_len=1,
                             max_kv_len=max_len)
        return self.proj(out.reshape(batch, dim))
