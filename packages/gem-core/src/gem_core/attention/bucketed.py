"""``bucketed``: pure-PyTorch jagged attention, batched over samples of similar length.

Samples are grouped into geometric length buckets (each bucket's width at most ``growth`` times
its shortest member), padded only to their bucket's width, and computed with batched matmuls. The
padded work is bounded by ``growth**2`` of the jagged work for attention (1.56x at the default),
against the batch maximum that padded SDPA pays; and there are a few dozen batched calls per layer
instead of one per sample, which is what makes the reference slow on CPU. No custom kernels: it
runs wherever PyTorch does and is differentiable by autograd.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from gem_core.attention.api import AttentionParams, validate_attention_inputs
from gem_core.attention.masks import self_attention_masks
from gem_core.attention.relative_bias import RelativeBias, bias_positions, relative_bias_values
from gem_core.contracts import AttentionBackend
from gem_core.jagged import lengths_from_offsets


def _buckets(lengths: Tensor, growth: float) -> list[Tensor]:
    """Sample indices per bucket of similar length; samples of length 0 are left out."""
    nonzero = torch.nonzero(lengths > 0).flatten()
    if nonzero.numel() == 0:
        return []
    bucket_of = torch.ceil(torch.log(lengths[nonzero].double()) / math.log(growth)).to(torch.int64)
    order = torch.argsort(bucket_of, stable=True)
    sorted_buckets = bucket_of[order]
    _, counts = torch.unique_consecutive(sorted_buckets, return_counts=True)
    return list(torch.split(nonzero[order], counts.tolist()))


def _gather_padded(values: Tensor, starts: Tensor, lengths: Tensor, width: int
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """``(n, width, ...)`` rows of ``values`` (zeros past each length), the flat index of each
    valid slot, and the validity mask ``(n, width)``."""
    positions = torch.arange(width, device=values.device)
    valid = positions[None, :] < lengths[:, None]
    index = (starts[:, None] + positions[None, :]).clamp(max=max(values.shape[0] - 1, 0))
    padded = values[index] * valid[..., None, None].to(values.dtype)
    return padded, index[valid], valid


def bucketed_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_offsets: Tensor,
    kv_offsets: Tensor,
    *,
    params: AttentionParams,
    num_targets: Tensor | None = None,
    max_q_len: int | None = None,
    max_kv_len: int | None = None,
    growth: float = 1.25,
    bias: RelativeBias | None = None,
) -> Tensor:
    """See :class:`gem_core.contracts.AttentionBackend`."""
    validate_attention_inputs(q, k, v, q_offsets, kv_offsets, params, num_targets, bias)
    # The backend does its own float32 (or float64) math; an enclosing bf16 autocast must
    # not recast its matmuls.
    with torch.autocast(device_type=q.device.type, enabled=False):
        return _bucketed_attention_fp(q, k, v, q_offsets, kv_offsets, params, num_targets, growth,
                                      bias)


def _bucket_bias(bias: RelativeBias, starts: Tensor, lengths: Tensor, targets: Tensor, width: int,
                 total: int, compute: torch.dtype) -> Tensor:
    """``(n, heads, width, width)`` relative bias of ``n`` samples padded to ``width`` (padding
    slots get finite values that the mask discards)."""
    index = torch.arange(width, device=starts.device)
    pos = bias_positions(index[None, :], lengths[:, None], targets[:, None])  # (n, width)
    token = (starts[:, None] + index[None, :]).clamp(max=max(total - 1, 0))
    values = relative_bias_values(bias, pos[:, :, None], pos[:, None, :], token[:, :, None],
                                  token[:, None, :])  # (heads, n, width, width)
    return values.transpose(0, 1).to(compute)


def _bucketed_attention_fp(q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor,
                           kv_offsets: Tensor, params: AttentionParams,
                           num_targets: Tensor | None, growth: float,
                           bias: RelativeBias | None = None) -> Tensor:
    is_self = torch.equal(q_offsets, kv_offsets)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = params.resolved_scale(q.shape[-1])
    q_lengths = lengths_from_offsets(q_offsets)
    kv_lengths = lengths_from_offsets(kv_offsets)
    # A sample contributes only if it has both queries and keys; otherwise its output is zero.
    active = torch.where(q_lengths > 0, kv_lengths, torch.zeros_like(kv_lengths))
    out = q.new_zeros(q.shape, dtype=compute)
    for members in _buckets(active, growth):
        q_len, kv_len = q_lengths[members], kv_lengths[members]
        q_width, kv_width = int(q_len.max()), int(kv_len.max())
        qb, q_index, q_valid = _gather_padded(q, q_offsets[members], q_len, q_width)
        kb, _, kv_valid = _gather_padded(k, kv_offsets[members], kv_len, kv_width)
        vb, _, _ = _gather_padded(v, kv_offsets[members], kv_len, kv_width)
        # (n, heads, Lq, Lk)
        scores = torch.einsum("nqhd,nkhd->nhqk", qb.to(compute), kb.to(compute)) * scale
        if is_self:
            targets = (num_targets[members].to(q_len.dtype) if num_targets is not None
                       else torch.zeros_like(q_len))
            mask = self_attention_masks(q_len, targets, params, q_width)
            if bias is not None:
                scores = scores + _bucket_bias(bias, q_offsets[members], q_len, targets, q_width,
                                               q.shape[0], compute)
        else:
            mask = q_valid[:, :, None] & kv_valid[:, None, :]
        # Padding query rows see key 0 so softmax stays finite; their output is discarded.
        mask = mask | (~q_valid[:, :, None] & (torch.arange(kv_width) == 0)[None, None, :])
        mask = mask[:, None]
        if params.normalization == "softmax":
            probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        else:
            probs = F.silu(scores) * mask / kv_len.to(compute)[:, None, None, None]
        attended = torch.einsum("nhqk,nkhd->nqhd", probs, vb.to(compute))
        out = out.index_put((q_index,), attended[q_valid])
    return out.to(q.dtype)


class BucketedAttention(AttentionBackend):
    """The ``bucketed`` backend object handed to the model."""

    name = "bucketed"

    def __init__(self, growth: float = 1.25) -> None:
        if growth <= 1.0:
            raise ValueError(f"growth must be > 1, got {growth}")
        self.growth = growth

    def __call__(self, q, k, v, q_offsets, kv_offsets, *, params, num_targets=None,
                 max_q_len=None, max_kv_len=None, bias=None):
        return bucketed_attention(q, k, v, q_offsets, kv_offsets, params=params,
                                  num_targets=num_targets, growth=self.growth, bias=bias)
