"""The reference attention backend: one sample at a time, dense masks, float32 or better math.

Slow and obviously right: it is the oracle every other backend is tested against. It never pads a
sample beyond its own length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from gem_core.attention.api import AttentionParams, validate_attention_inputs
from gem_core.attention.masks import self_attention_mask
from gem_core.attention.relative_bias import RelativeBias, bias_positions, relative_bias_values
from gem_core.contracts import AttentionBackend


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def reference_attention(
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
    bias: RelativeBias | None = None,
) -> Tensor:
    """See :class:`gem_core.contracts.AttentionBackend`."""
    validate_attention_inputs(q, k, v, q_offsets, kv_offsets, params, num_targets, bias)
    # The backend does its own float32 (or float64) math; an enclosing bf16 autocast must
    # not recast its matmuls.
    with torch.autocast(device_type=q.device.type, enabled=False):
        return _reference_attention_fp(q, k, v, q_offsets, kv_offsets, params, num_targets,
                                       bias)


def _sample_bias(bias: RelativeBias, start: int, length: int, num_targets: int,
                 compute: torch.dtype) -> Tensor:
    """``(heads, length, length)`` relative bias of the sample starting at token ``start``."""
    index = torch.arange(length, device=bias.position_weights.device)
    pos = bias_positions(index, torch.tensor(length, device=index.device),
                         torch.tensor(num_targets, device=index.device))
    token = start + index
    return relative_bias_values(bias, pos[:, None], pos[None, :], token[:, None],
                                token[None, :]).to(compute)


def _reference_attention_fp(q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor,
                            kv_offsets: Tensor, params: AttentionParams,
                            num_targets: Tensor | None, bias: RelativeBias | None = None
                            ) -> Tensor:
    compute = _compute_dtype(q.dtype)
    scale = params.resolved_scale(q.shape[-1])
    is_self = torch.equal(q_offsets, kv_offsets)
    q_bounds = q_offsets.tolist()
    kv_bounds = kv_offsets.tolist()
    targets = num_targets.tolist() if num_targets is not None else None
    outputs = []
    for b in range(len(q_bounds) - 1):
        qs, qe = q_bounds[b], q_bounds[b + 1]
        ks, ke = kv_bounds[b], kv_bounds[b + 1]
        if qe == qs:
            continue
        if ke == ks:
            outputs.append(q.new_zeros((qe - qs, *q.shape[1:])))
            continue
        qb = q[qs:qe].to(compute).transpose(0, 1)  # (heads, Lq, d)
        kb = k[ks:ke].to(compute).transpose(0, 1)
        vb = v[ks:ke].to(compute).transpose(0, 1)
        scores = torch.matmul(qb, kb.transpose(-1, -2)) * scale  # (heads, Lq, Lk)
        if bias is not None:  # self-attention only (validated)
            scores = scores + _sample_bias(bias, qs, qe - qs, targets[b] if targets else 0,
                                           compute)
        if is_self:
            mask = self_attention_mask(qe - qs, targets[b] if targets else 0, params, q.device)
        else:
            mask = torch.ones(qe - qs, ke - ks, dtype=torch.bool, device=q.device)
        if params.normalization == "softmax":
            # Every self-attention query sees at least itself, so no row is fully masked.
            probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        else:
            probs = F.silu(scores) * mask / (ke - ks)
        out = torch.matmul(probs, vb).transpose(0, 1)
        outputs.append(out.to(q.dtype))
    if not outputs:
        return q.new_zeros(q.shape)
    return torch.cat(outputs, dim=0)


class ReferenceAttention(AttentionBackend):
    """The ``reference`` backend object handed to the model."""

    name = "reference"

    def __call__(self, q, k, v, q_offsets, kv_offsets, *, params, num_targets=None,
                 max_q_len=None, max_kv_len=None, bias=None):
        return reference_attention(q, k, v, q_offsets, kv_offsets, params=params,
                                   num_targets=num_targets, bias=bias)
