"""Cross-feature attention: history tokens (long query) attend to their sample's non-sequence
tokens (short K/V), so the two groups learn from each other before the history is summarised."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gem_core.attention import AttentionParams
from gem_core.contracts import AttentionBackend
from gem_core.flops import attention_flops, cross_pairs

_FULL = AttentionParams()  # every query sees every key of its own sample


class CrossFeatureAttention(nn.Module):
    """Pre-norm residual cross-attention from ``(T, d)`` jagged history to ``(B, C, d)`` context."""

    def __init__(self, dim: int, heads: int, attention: AttentionBackend) -> None:
        super().__init__()
        self.heads, self.attention = heads, attention
        self.norm = nn.RMSNorm(dim)
        self.context_norm = nn.RMSNorm(dim)
        self.query = nn.Linear(dim, dim, bias=False)
        self.key_value = nn.Linear(dim, 2 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        # Zero-initialised output: the block starts as the identity, so switching it on does
        # not disturb the self-attention stack's early training.
        nn.init.zeros_(self.proj.weight)

    def forward(self, x: Tensor, offsets: Tensor, max_len: int, context: Tensor) -> Tensor:
        tokens, dim = x.shape
        batch, num_context, _ = context.shape
        head_dim = dim // self.heads
        q = self.query(self.norm(x)).view(tokens, self.heads, head_dim)
        kv = self.key_value(self.context_norm(context.reshape(batch * num_context, dim)))
        k, v = kv.view(-1, 2, self.heads, head_dim).unbind(1)
        kv_offsets = torch.arange(batch + 1, device=x.device, dtype=offsets.dtype) * num_context
        out = self.attention(q, k, v, offsets, kv_offsets, params=_FULL, max_q_len=max_len,
                             max_kv_len=num_context)
        return x + self.proj(out.reshape(tokens, dim))

    def flops(self, lengths: Tensor, num_context: int) -> dict[str, int]:
        """Forward FLOPs: projections and attention (matmuls only)."""
        tokens, batch = int(lengths.sum()), lengths.numel()
        dim = self.query.in_features
        linear = 2 * tokens * dim * dim * 2 + 2 * batch * num_context * dim * 2 * dim
        return {"linear": linear, "attention": attention_flops(cross_pairs(lengths, num_context),
                                                               dim)}
