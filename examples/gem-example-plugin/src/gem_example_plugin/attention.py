"""Softmax jagged attention, one sample at a time through torch SDPA with an explicit mask."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gem_core.attention import AttentionParams, RelativeBias, validate_attention_inputs
from gem_core.attention.api import reject_unsupported_bias, reject_unsupported_normalization
from gem_core.attention.masks import self_attention_mask
from gem_core.capabilities import SOFTMAX
from gem_core.contracts import AttentionBackend


class SdpaAttention(AttentionBackend):
    name = "example-sdpa"

    def __call__(self, q, k, v, q_offsets, kv_offsets, *, params: AttentionParams,
                 num_targets=None, max_q_len=None, max_kv_len=None,
                 bias: RelativeBias | None = None):
        # The whole signature of the contract: a bias or a normalisation this backend does not
        # declare (its capabilities: softmax only) is refused by name, never ignored.
        reject_unsupported_bias(self.name, bias)
        reject_unsupported_normalization(self.name, params, (SOFTMAX,))
        validate_attention_inputs(q, k, v, q_offsets, kv_offsets, params, num_targets)
        is_self = torch.equal(q_offsets, kv_offsets)
        scale = params.resolved_scale(q.shape[-1])
        out = torch.zeros_like(q)
        pieces = []
        for b in range(q_offsets.numel() - 1):
            qs, qe = int(q_offsets[b]), int(q_offsets[b + 1])
            ks, ke = int(kv_offsets[b]), int(kv_offsets[b + 1])
            if qe == qs or ke == ks:
                continue
            mask = None
            if is_self:
                targets = int(num_targets[b]) if num_targets is not None else 0
                mask = self_attention_mask(qe - qs, targets, params, q.device)
            attended = F.scaled_dot_product_attention(
                q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1),
                attn_mask=mask, scale=scale)
            pieces.append((qs, qe, attended.transpose(0, 1)))
        for qs, qe, attended in pieces:
            out = out.index_copy(0, torch.arange(qs, qe, device=q.device), attended)
        return out
