"""Target-aware attention: the candidate ad's tokens query their own user's tokens (short q,
long K/V): the PMA user tokens, if any, and the most recent history tokens."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gem_core.attention import AttentionParams
from gem_core.contracts import AttentionBackend
from gem_core.flops import attention_flops, cross_pairs


def recent_lengths(lengths: Tensor, recent: int) -> Tensor:
    """History tokens target-aware attention sees per sample (``recent`` 0: all of them)."""
    return lengths.clamp(max=recent) if recent else lengths


def gather_keys(history: Tensor, offsets: Tensor, user_tokens: Tensor | None,
                recent: int) -> tuple[Tensor, Tensor]:
    """Per sample, its user tokens followed by its last ``recent`` history tokens, jagged:
    ``(total, d)`` and offsets ``(B + 1,)``. With no user tokens and ``recent`` 0 this is the
    history itself (no copy)."""
    if user_tokens is None and not recent:
        return history, offsets
    lengths = offsets[1:] - offsets[:-1]
    batch = lengths.numel()
    num_user = 0 if user_tokens is None else user_tokens.shape[1]
    kv_lengths = recent_lengths(lengths, recent) + num_user
    kv_offsets = torch.zeros_like(offsets)
    torch.cumsum(kv_lengths, 0, out=kv_offsets[1:])
    rows = torch.repeat_interleave(torch.arange(batch, device=offsets.device), kv_lengths)
    position = torch.arange(rows.numel(), device=offsets.device) - kv_offsets[rows]
    # History slot p >= num_user takes event end - kept + (p - num_user) of its sample.
    kept = kv_lengths - num_user
    history_index = offsets[rows + 1] - kept[rows] + (position - num_user)
    if user_tokens is None:
        return history[history_index], kv_offsets
    source = torch.cat([history, user_tokens.reshape(-1, history.shape[1])])
    user_index = history.shape[0] + rows * num_user + position
    return source[torch.where(position < num_user, user_index, history_index)], kv_offsets


class TargetAwareAttention(nn.Module):
    """Q query tokens per sample (the candidate, optionally the non-sequence tokens too) over
    that sample's user tokens and recent history.

    A sample with no keys (empty history and no PMA) gets a zero vector (the attention API's
    contract), so its prediction rests on the other tokens.
    """

    def __init__(self, dim: int, heads: int, attention: AttentionBackend,
                 recent: int = 0, normalization: str = "softmax") -> None:
        super().__init__()
        self.heads, self.attention, self.recent = heads, attention, recent
        # Every query sees every key of its own sample; softmax or pointwise SiLU weights.
        self.params = AttentionParams(normalization=normalization)
        self.query = nn.Linear(dim, dim, bias=False)
        self.key_value = nn.Linear(dim, 2 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, queries: Tensor, history: Tensor, offsets: Tensor, max_len: int,
                user_tokens: Tensor | None = None, candidate_offsets: Tensor | None = None,
                max_candidates: int = 1) -> Tensor:
        """``queries`` ``(N, d)`` or ``(N, Q, d)``, one entry per candidate; request ``r``'s
        candidates are rows ``candidate_offsets[r]:candidate_offsets[r + 1]`` (None: one
        candidate per request) and all attend to that request's keys, which are projected once
        per request. Returns the shape of ``queries``."""
        single = queries.dim() == 2
        queries = queries.unsqueeze(1) if single else queries
        rows, num_queries, dim = queries.shape
        head_dim = dim // self.heads
        keys, kv_offsets = gather_keys(history, offsets, user_tokens, self.recent)
        max_kv = (min(max_len, self.recent) if self.recent else max_len) + (
            0 if user_tokens is None else user_tokens.shape[1])
        q = self.query(queries).view(rows * num_queries, self.heads, head_dim)
        k, v = self.key_value(keys).view(-1, 2, self.heads, head_dim).unbind(1)
        if candidate_offsets is None:
            candidate_offsets = torch.arange(offsets.numel(), device=queries.device,
                                             dtype=offsets.dtype)
        q_offsets = candidate_offsets.to(offsets.dtype) * num_queries
        out = self.attention(q, k, v, q_offsets, kv_offsets, params=self.params,
                             max_q_len=num_queries * max_candidates, max_kv_len=max_kv)
        out = self.proj(out.reshape(rows, num_queries, dim))
        return out.squeeze(1) if single else out

    def flops(self, lengths: Tensor, num_queries: int, num_user: int,
              candidates: Tensor | None = None) -> dict[str, int]:
        """Forward FLOPs (matmuls only); ``candidates``: per request (None: one each)."""
        dim = self.query.in_features
        lengths = lengths.to(torch.int64)
        candidates = torch.ones_like(lengths) if candidates is None else candidates.to(torch.int64)
        kv_lengths = recent_lengths(lengths, self.recent) + num_user
        impressions = int(candidates.sum())
        linear = (2 * 2 * impressions * num_queries * dim * dim
                  + 2 * int(kv_lengths.sum()) * dim * 2 * dim)
        return {"linear": linear,
                "attention": attention_flops(cross_pairs(num_queries * candidates, kv_lengths),
                                             dim)}
