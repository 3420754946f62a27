"""The ``fbgemm`` attention backend: FBGEMM's compiled jagged operators (C++ on CPU, CUDA on GPU).

Heads are folded into the batch (``heads * batch`` jagged sequences, head-major), then

1. ``fbgemm.jagged_to_padded_dense`` lays each sample's K and V out to the longest K/V of the
   batch (the short side for cross-attention, and only K/V: queries stay jagged);
2. ``fbgemm.jagged_dense_bmm`` computes scores ``(total_q, max_kv_len)`` = jagged Q x padded K^T;
3. the mask (causal, window, prefix, targets, key padding) is applied and rows normalised
   (softmax, or SiLU divided by the sample's number of keys);
4. ``fbgemm.jagged_dense_bmm`` again computes jagged P x padded V.

All four have CPU kernels and autograd in fbgemm_gpu 1.8.0, so backward comes from them. The work
is ``total_q x max_kv_len`` per head: no padding on the query side, but no block skipping for a
local window either (that is what the ``triton`` backend is for). Math runs in float32.
"""

from __future__ import annotations

import fbgemm_gpu  # noqa: F401  (importing it registers torch.ops.fbgemm.*)
import torch
import torch.nn.functional as F
from torch import Tensor

from gem_core.attention.api import AttentionParams, reject_unsupported_bias
from gem_core.attention.relative_bias import RelativeBias
from gem_core.contracts import AttentionBackend
from gem_kernels.attention.common import checked_inputs, max_length
from gem_kernels.attention.jagged_mask import jagged_visible_mask

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Finite, so a row with no visible key (a sample without keys) softmaxes to a uniform row that
# the mask then zeroes, instead of NaN that would poison the backward pass.
_MASKED_SCORE = -1.0e30


def _head_major_offsets(offsets: Tensor, total: int, heads: int) -> Tensor:
    """Offsets of ``heads * batch`` sequences laid out head after head."""
    starts = offsets[:-1][None, :] + total * torch.arange(heads, device=offsets.device)[:, None]
    end = torch.tensor([heads * total], dtype=offsets.dtype, device=offsets.device)
    return torch.cat([starts.flatten(), end])


class FbgemmAttention(AttentionBackend):
    """Jagged attention on fbgemm jagged operators: every shape, mask and normalisation."""

    name = "fbgemm"

    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, kv_offsets: Tensor, *,
        params: AttentionParams, num_targets: Tensor | None = None,
        max_q_len: int | None = None, max_kv_len: int | None = None,
        bias: RelativeBias | None = None,
    ) -> Tensor:
        reject_unsupported_bias("fbgemm", bias)
        is_self = checked_inputs("fbgemm", DTYPES, q, k, v, q_offsets, kv_offsets, params,
                                 num_targets)
        total_q, heads, head_dim = q.shape
        total_kv = k.shape[0]
        max_q = max_length(q_offsets, max_q_len)
        max_kv = max_length(kv_offsets, max_kv_len)
        if total_q == 0 or total_kv == 0 or max_kv == 0:
            return q.new_zeros(q.shape)
        q_offsets = q_offsets.to(torch.int64)
        kv_offsets = kv_offsets.to(torch.int64)
        qh = q.float().transpose(0, 1).reshape(heads * total_q, head_dim)
        kh = k.float().transpose(0, 1).reshape(heads * total_kv, head_dim)
        vh = v.float().transpose(0, 1).reshape(heads * total_kv, head_dim)
        q_off_h = _head_major_offsets(q_offsets, total_q, heads)
        kv_off_h = _head_major_offsets(kv_offsets, total_kv, heads)

        k_pad = torch.ops.fbgemm.jagged_to_padded_dense(kh, [kv_off_h], [max_kv], 0.0)
        v_pad = torch.ops.fbgemm.jagged_to_padded_dense(vh, [kv_off_h], [max_kv], 0.0)
        scores, _ = torch.ops.fbgemm.jagged_dense_bmm(
            qh, q_off_h, k_pad.transpose(1, 2).contiguous(), max_q
        )
        scores = scores * params.resolved_scale(head_dim)  # (heads * total_q, max_kv)

        mask = jagged_visible_mask(q_offsets, kv_offsets, max_kv, params, num_targets, is_self)
        mask = mask.repeat(heads, 1)
        if params.normalization == "softmax":
            probs = torch.softmax(scores.masked_fill(~mask, _MASKED_SCORE), dim=-1) * mask
        else:
            kv_len = (kv_offsets[1:] - kv_offsets[:-1]).clamp(min=1)
            per_row = torch.repeat_interleave(kv_len, q_offsets[1:] - q_offsets[:-1],
                                              output_size=total_q)
            probs = F.silu(scores) * mask / per_row.repeat(heads)[:, None].float()
        out, _ = torch.ops.fbgemm.jagged_dense_bmm(probs, q_off_h, v_pad, max_q)
        return out.reshape(heads, total_q, head_dim).transpose(0, 1).to(q.dtype)
