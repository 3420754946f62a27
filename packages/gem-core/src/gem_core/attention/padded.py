"""``padded``: pure-PyTorch jagged attention padded to the batch maximum, with no data-dependent
control flow, so ``torch.export`` and AOTInductor can capture it with dynamic batch and lengths.

Every sample is gathered into a ``(B, width, heads, head_dim)`` block, where the width is the
``max_q_len`` / ``max_kv_len`` the caller passes (the model takes them from its inputs), scored
with one batched matmul under the mask of :mod:`gem_core.attention.masks`, and the valid rows
are gathered back into the jagged layout. The padded work is ``B x max^2`` (what ``bucketed``
avoids with its length buckets); for serving, where a request's history is scored once and the
candidates are few queries each, one graph with no Python loops is what matters. It is the
backend ``gem export-model`` swaps in for one that has no export path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from gem_core.attention.api import (
    AttentionParams,
    needs_self_attention,
    reject_unsupported_bias,
    validate_attention_inputs,
)
from gem_core.attention.masks import visible
from gem_core.attention.relative_bias import RelativeBias
from gem_core.contracts import AttentionBackend
from gem_core.jagged import max_length


def _gather_padded(values: Tensor, offsets: Tensor, lengths: Tensor, width: int | torch.SymInt
                   ) -> tuple[Tensor, Tensor]:
    """``(B, width, ...)`` rows of ``values`` (zeros past each length) and the validity mask
    ``(B, width)``. One zero row is appended so that padding slots (and an empty ``values``)
    have somewhere to read from."""
    positions = torch.arange(width, device=values.device)
    valid = positions[None, :] < lengths[:, None]
    padded_values = torch.cat([values, values.new_zeros((1, *values.shape[1:]))])
    index = torch.where(valid, offsets[:-1, None] + positions[None, :], values.shape[0])
    return padded_values[index], valid


def padded_attention(
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
    """See :class:`gem_core.contracts.AttentionBackend`. ``max_q_len`` and ``max_kv_len`` must
    bound the samples' lengths when given (None: read from the offsets)."""
    reject_unsupported_bias("padded", bias)
    if torch.compiler.is_compiling():
        # Value checks read tensors back to Python, which a captured graph cannot do; the
        # shapes are still checked, the values were checked when the batch was made.
        if q.dim() != 3 or k.shape != v.shape or q.shape[1:] != k.shape[1:]:
            raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                             "disagree")
    else:
        validate_attention_inputs(q, k, v, q_offsets, kv_offsets, params, num_targets, bias)
    q_lengths = q_offsets[1:] - q_offsets[:-1]
    kv_lengths = kv_offsets[1:] - kv_offsets[:-1]
    q_width = max_q_len if max_q_len is not None else max_length(q_lengths)
    kv_width = max_kv_len if max_kv_len is not None else max_length(kv_lengths)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    with torch.autocast(device_type=q.device.type, enabled=False):
        qb, q_valid = _gather_padded(q.to(compute), q_offsets, q_lengths, q_width)
        kb, kv_valid = _gather_padded(k.to(compute), kv_offsets, kv_lengths, kv_width)
        vb, _ = _gather_padded(v.to(compute), kv_offsets, kv_lengths, kv_width)
        scale = params.resolved_scale(q.shape[-1])
        scores = torch.einsum("bqhd,bkhd->bhqk", qb, kb) * scale
        if needs_self_attention(params, num_targets):
            targets = (num_targets.to(torch.int64) if num_targets is not None
                       else torch.zeros_like(q_lengths))
            i = torch.arange(q_width, device=q.device)[None, :, None]
            j = torch.arange(kv_width, device=q.device)[None, None, :]
            mask = visible(i, j, q_lengths.to(torch.int64)[:, None, None],
                           targets[:, None, None], params)
        else:
            mask = q_valid[:, :, None] & kv_valid[:, None, :]
        mask = mask[:, None]  # (B, 1, Lq, Lk)
        if params.normalization == "softmax":
            probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
            # A row with no visible key (padding, or a sample with no keys) is all -inf: NaN.
            probs = torch.where(mask.any(dim=-1, keepdim=True), probs, 0.0)
        else:
            probs = (F.silu(scores) * mask
                     / kv_lengths.clamp(min=1).to(compute)[:, None, None, None])
        attended = torch.einsum("bhqk,bkhd->bqhd", probs, vb)
        # Back to the jagged layout: query token t is row ``sample`` position ``t - start``.
        sample = torch.repeat_interleave(torch.arange(q_lengths.shape[0], device=q.device),
                                         q_lengths, output_size=q.shape[0])
        position = torch.arange(q.shape[0], device=q.device) - q_offsets[:-1][sample]
        return attended[sample, position].to(q.dtype)


class PaddedAttention(AttentionBackend):
    """The ``padded`` backend object handed to the model."""

    name = "padded"

    def __call__(self, q, k, v, q_offsets, kv_offsets, *, params, num_targets=None,
                 max_q_len=None, max_kv_len=None, bias=None):
        return padded_attention(q, k, v, q_offsets, kv_offsets, params=params,
                                num_targets=num_targets, max_q_len=max_q_len,
                                max_kv_len=max_kv_len, bias=bias)
