"""The ``triton`` attention backend object: checks the call and launches the custom op."""

from __future__ import annotations

import torch
from torch import Tensor

from gem_core.attention.api import AttentionParams
from gem_core.attention.relative_bias import RelativeBias
from gem_core.contracts import AttentionBackend
from gem_kernels.attention.common import MAX_WINDOW, checked_inputs, max_length
from gem_kernels.attention.launch_settings import BackwardLaunch, check_backward_launch
from gem_kernels.attention.triton_op import (
    check_device,
    jagged_attention,
    kernels_are_interpreted,
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class TritonAttention(AttentionBackend):
    """Jagged attention on Triton kernels: every shape, mask and normalisation, with backward.

    ``block_m``/``block_n`` are the query/key tile sizes (powers of two, at least 16); None picks
    64, or 32 for fp32 inputs with head_dim > 64, whose fp32 tiles would not fit in shared memory.
    ``backward`` sets the backward kernels' own tiles, warps and stages (eager mode; a tuning
    knob): None launches them with ``(block_m, block_n)`` and 4 warps.
    Only the 64 x 64 default has been checked on a GPU (H200, bf16); two backward launch settings
    gave wrong gradients there (docs/perf.md) and are refused by name on CUDA
    (:data:`~gem_kernels.attention.launch_settings.WRONG_ON_CUDA`), so check other tiles with
    ``tools/gpu_check.sh`` or ``python -m gem_kernels.bench.gpu_tune`` before relying on them.
    """

    name = "triton"

    def __init__(self, block_m: int | None = None, block_n: int | None = None,
                 backward: BackwardLaunch | None = None) -> None:
        for label, size in (("block_m", block_m), ("block_n", block_n)):
            if size is not None and (size < 16 or size & (size - 1)):
                raise ValueError(f"{label} must be a power of two >= 16, got {size}")
        self.block_m = block_m
        self.block_n = block_n
        self.backward = backward

    def _blocks(self, q: Tensor) -> tuple[int, int]:
        default = 32 if q.dtype == torch.float32 and q.shape[-1] > 64 else 64
        return self.block_m or default, self.block_n or default

    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, kv_offsets: Tensor, *,
        params: AttentionParams, num_targets: Tensor | None = None,
        max_q_len: int | None = None, max_kv_len: int | None = None,
        bias: RelativeBias | None = None,
    ) -> Tensor:
        is_self = checked_inputs("triton", DTYPES, q, k, v, q_offsets, kv_offsets, params,
                                 num_targets, bias)
        check_device(q)
        if self.backward is not None:  # refused before the forward runs, not in the backward
            check_backward_launch(self.backward, device_type=q.device.type,
                                  interpreted=kernels_are_interpreted())
        bias_args = {}
        if bias is not None:
            # One fp32 table, position weights then time weights; autograd routes its gradient
            # back through the concatenation and the casts to the two weight tensors.
            tables = [bias.position_weights] + ([bias.time_weights]
                                                if bias.time_weights is not None else [])
            bias_args = dict(
                bias_weights=torch.cat([t.float() for t in tables], dim=1).contiguous(),
                timestamps=bias.timestamps, num_position_buckets=bias.num_position_buckets,
                time_divisor=float(bias.time_bucket_divisor))
        if num_targets is None:
            num_targets = torch.zeros(q_offsets.numel() - 1, dtype=torch.int64, device=q.device)
        window = -1 if params.window is None else min(params.window, MAX_WINDOW)
        block_m, block_n = self._blocks(q)
        return jagged_attention(
            q.contiguous(), k.contiguous(), v.contiguous(),
            q_offsets.to(torch.int64).contiguous(), kv_offsets.to(torch.int64).contiguous(),
            num_targets.to(torch.int64).contiguous(),
            is_self, params.causal, window, min(params.num_prefix, MAX_WINDOW),
            params.normalization == "silu", params.resolved_scale(q.shape[-1]),
            max_length(q_offsets, max_q_len), max_length(kv_offsets, max_kv_len),
            block_m, block_n, **bias_args, backward_launch=self.backward,
        )
