"""PMA (pooled multi-head attention): K learned queries per sample over the tower's output.

The result, K tokens per user, is the candidate-independent user embedding: it depends on the
history only, so an upstream stage can compute and cache it once per user and request time.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gem_core.attention import AttentionParams
from gem_core.contracts import AttentionBackend
from gem_core.flops import attention_flops, cross_pairs

_FULL = AttentionParams()  # every query sees every key of its own sample


class PooledMultiheadAttention(nn.Module):
    """``(T, d)`` jagged history -> ``(B, K, d)`` user tokens (short query, long K/V).

    A sample with an empty history gets its learned seeds (projected) instead of zeros, so an
    empty history is still a distinguishable, learnable state.
    """

    def __init__(self, dim: int, heads: int, num_queries: int, attention: AttentionBackend) -> None:
        super().__init__()
        self.heads, self.num_queries, self.attention = heads, num_queries, attention
        self.seeds = nn.Parameter(torch.randn(num_queries, dim) / dim ** 0.5)
        self.query = nn.Linear(dim, dim, bias=False)
        self.key_value = nn.Linear(dim, 2 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm = nn.RMSNorm(dim)

    def forward(self, history: Tensor, offsets: Tensor, max_len: int) -> Tensor:
        batch, dim = offsets.numel() - 1, history.shape[1]
        k_queries, head_dim = self.num_queries, dim // self.heads
        # The queries are the same for every sample: project the K seeds once, then repeat.
        # (a repeat, not expand + reshape: that copies too, and under torch.export its view
        # check would specialise the program to batches of two or more requests)
        q = self.query(self.seeds).view(k_queries, self.heads, head_dim).repeat(batch, 1, 1)
        k, v = self.key_value(history).view(-1, 2, self.heads, head_dim).unbind(1)
        q_offsets = torch.arange(batch + 1, device=history.device,
                                 dtype=offsets.dtype) * k_queries
        out = self.attention(q, k, v, q_offsets, offsets, params=_FULL, max_q_len=k_queries,
                             max_kv_len=max_len)
        pooled = self.proj(out.reshape(batch, k_queries, dim))
        return self.norm(pooled + self.seeds)

    def flops(self, lengths: Tensor) -> dict[str, int]:
        """Forward FLOPs (matmuls only)."""
        tokens, batch = int(lengths.sum()), lengths.numel()
        dim, k_queries = self.query.in_features, self.num_queries
        linear = (2 * k_queries * dim * dim + 2 * tokens * dim * 2 * dim
                  + 2 * batch * k_queries * dim * dim)
        return {"linear": linear,
                "attention": attention_flops(cross_pairs(lengths, k_queries), dim)}
