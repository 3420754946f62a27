"""The ``torch-sdpa`` attention backend: PyTorch's fused SDPA kernel, one sample at a time.

No sample is padded to the batch maximum: each runs ``scaled_dot_product_attention`` on its own
length (``is_causal`` when the mask is plain causal, else the boolean mask of
:mod:`gem_core.attention.masks`). On a CPU this is the fast jagged path (PyTorch's CPU flash
kernel, no interpreter); on a GPU the per-sample launches make it a peer, not a contender.
Softmax only: SDPA has no SiLU normalisation, and asking for it raises.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from gem_core.attention.api import (
    AttentionParams,
    reject_unsupported_bias,
    reject_unsupported_normalization,
)
from gem_core.attention.masks import self_attention_mask
from gem_core.attention.relative_bias import RelativeBias
from gem_core.capabilities import SOFTMAX
from gem_core.contracts import AttentionBackend
from gem_kernels.attention.common import checked_inputs

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class TorchSdpaAttention(AttentionBackend):
    """Jagged softmax attention as a loop of per-sample fused SDPA calls."""

    name = "torch-sdpa"

    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, kv_offsets: Tensor, *,
        params: AttentionParams, num_targets: Tensor | None = None,
        max_q_len: int | None = None, max_kv_len: int | None = None,
        bias: RelativeBias | None = None,
    ) -> Tensor:
        reject_unsupported_bias("torch-sdpa", bias)
        reject_unsupported_normalization("torch-sdpa", params, (SOFTMAX,))  # SDPA has no SiLU
        is_self = checked_inputs("torch-sdpa", DTYPES, q, k, v, q_offsets, kv_offsets, params,
                                 num_targets)
        scale = params.resolved_scale(q.shape[-1])
        # Plain causal self-attention lets SDPA use its causal kernel without a mask tensor.
        plain_causal = (is_self and params.causal and params.window is None
                        and params.num_prefix == 0 and num_targets is None)
        masked = is_self and not plain_causal and (
            params.is_self_attention_only or num_targets is not None)
        q_bounds, kv_bounds = q_offsets.tolist(), kv_offsets.tolist()
        targets = num_targets.tolist() if num_targets is not None else None
        outputs = []
        for b in range(len(q_bounds) - 1):
            qs, qe, ks, ke = q_bounds[b], q_bounds[b + 1], kv_bounds[b], kv_bounds[b + 1]
            if qe == qs:
                continue
            if ke == ks:  # no keys: zeros, by the API's contract
                outputs.append(q.new_zeros((qe - qs, *q.shape[1:])))
                continue
            mask = None
            if masked:
                mask = self_attention_mask(qe - qs, targets[b] if targets else 0, params,
                                           q.device)
            # (1, heads, len, d): PyTorch's fused kernels take 4-D inputs only; 3-D ones drop to
            # the unfused math path, 10-50x slower on CPU.
            out = F.scaled_dot_product_attention(
                *(t.transpose(0, 1).unsqueeze(0) for t in (q[qs:qe], k[ks:ke], v[ks:ke])),
                attn_mask=mask, is_causal=plain_causal, scale=scale,
            )
            outputs.append(out[0].transpose(0, 1))
        if not outputs:
            return q.new_zeros(q.shape)
        return torch.cat(outputs, dim=0)
