"""The ``blocked`` backend as ``torch.library`` custom ops, so ``torch.compile`` traces it whole.

The backend's tile loop is Python control flow over values read from the batch (span widths,
tile groups), which dynamo cannot trace without a graph break per call. Under ``torch.compile``
the call is instead one opaque custom op with a fake implementation (the output has ``q``'s
shape and dtype), so the compiled block keeps a single graph and the code generated around it
(norms, projections, MLP) is fused; at run time the op runs the eager backend's code unchanged.
Eager calls never go through the op (:class:`~gem_kernels.attention.blocked_backend.
BlockedAttention` dispatches on :func:`torch.compiler.is_compiling`), since a custom op costs
several times the host time of a plain call.

``gem_kernels::blocked_attention_fwd`` returns the output. ``gem_kernels::blocked_attention_bwd``
returns ``(dq, dk, dv, d_position_weights, d_time_weights)`` (an empty tensor for a weight the
call has not got). Every option of the backend is an argument: softmax and SiLU, causality, the
local window (``-1``: none), contextual prefix, target counts, the relative bias (position and
time weights, timestamps, divisor), cross-attention and PMA (different ``q`` and ``kv``
offsets), and the tile sizes (``0``: automatic).

The backward recomputes the forward under :func:`torch.func.vjp` (autograd is switched off
inside a custom op's implementation; functorch's transform brings its own): it gives the eager
backward's gradients exactly, at the price of one more attention forward per backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gem_core.attention.api import AttentionParams
from gem_core.attention.relative_bias import RelativeBias
from gem_kernels.attention.blocked_tiles import blocked_attention


def _params(causal: bool, window: int, num_prefix: int, silu: bool, scale: float
            ) -> AttentionParams:
    return AttentionParams(causal=causal, window=None if window < 0 else window,
                           num_prefix=num_prefix, normalization="silu" if silu else "softmax",
                           scale=scale)


def _attend(q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, kv_offsets: Tensor,
            num_targets: Tensor | None, position_weights: Tensor | None,
            time_weights: Tensor | None, timestamps: Tensor | None, params: AttentionParams,
            block_q: int, block_k: int, time_bucket_divisor: float) -> Tensor:
    bias = (None if position_weights is None else
            RelativeBias(position_weights=position_weights, time_weights=time_weights,
                         timestamps=timestamps, time_bucket_divisor=time_bucket_divisor))
    return blocked_attention(q, k, v, q_offsets, kv_offsets, params=params,
                             num_targets=num_targets, block_q=block_q or None,
                             block_k=block_k or None, bias=bias)


@torch.library.custom_op("gem_kernels::blocked_attention_fwd", mutates_args=())
def blocked_attention_fwd(
    q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, kv_offsets: Tensor,
    num_targets: Tensor | None, position_weights: Tensor | None, time_weights: Tensor | None,
    timestamps: Tensor | None, causal: bool, window: int, num_prefix: int, silu: bool,
    scale: float, block_q: int, block_k: int, time_bucket_divisor: float,
) -> Tensor:
    """The blocked attention output (the eager backend's code, inputs fully validated)."""
    return _attend(q, k, v, q_offsets, kv_offsets, num_targets, position_weights, time_weights,
                   timestamps, _params(causal, window, num_prefix, silu, scale), block_q,
                   block_k, time_bucket_divisor)


@blocked_attention_fwd.register_fake
def _(q, k, v, q_offsets, kv_offsets, num_targets, position_weights, time_weights, timestamps,
      causal, window, num_prefix, silu, scale, block_q, block_k, time_bucket_divisor):
    return torch.empty_like(q)


@torch.library.custom_op("gem_kernels::blocked_attention_bwd", mutates_args=())
def blocked_attention_bwd(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, kv_offsets: Tensor,
    num_targets: Tensor | None, position_weights: Tensor | None, time_weights: Tensor | None,
    timestamps: Tensor | None, causal: bool, window: int, num_prefix: int, silu: bool,
    scale: float, block_q: int, block_k: int, time_bucket_divisor: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of q, k, v and of the bias weights (empty where there is no such weight)."""
    params = _params(causal, window, num_prefix, silu, scale)
    weights = tuple(w for w in (position_weights, time_weights) if w is not None)

    def attend(q: Tensor, k: Tensor, v: Tensor, *bias_weights: Tensor) -> Tensor:
        position, time = (*bias_weights, None, None)[:2]
        return _attend(q, k, v, q_offsets, kv_offsets, num_targets, position, time, timestamps,
                       params, block_q, block_k, time_bucket_divisor)

    _, vjp = torch.func.vjp(attend, q, k, v, *weights)
    grads = list(vjp(grad_out))
    # A custom op's outputs may not alias each other: one empty tensor per missing weight.
    grads += [q.new_empty((0,), dtype=torch.float32) for _ in range(5 - len(grads))]
    return tuple(grads)


@blocked_attention_bwd.register_fake
def _(grad_out, q, k, v, q_offsets, kv_offsets, num_targets, position_weights, time_weights,
      timestamps, causal, window, num_prefix, silu, scale, block_q, block_k,
      time_bucket_divisor):
    def weight_grad(weight: Tensor | None) -> Tensor:
        return (q.new_empty((0,), dtype=torch.float32) if weight is None
                else torch.empty_like(weight))

    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            weight_grad(position_weights), weight_grad(time_weights))


_TENSORS = 9  # q ... timestamps: the differentiable and index inputs before the options


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:_TENSORS])
    ctx.options = tuple(inputs[_TENSORS:])


def _backward(ctx, grad_out: Tensor):
    saved = ctx.saved_tensors
    dq, dk, dv, d_position, d_time = torch.ops.gem_kernels.blocked_attention_bwd(
        grad_out, *saved, *ctx.options)
    position_weights, time_weights = saved[6], saved[7]
    return (dq, dk, dv, None, None, None,
            d_position if position_weights is not None else None,
            d_time if time_weights is not None else None,
            None) + (None,) * len(ctx.options)


torch.library.register_autograd("gem_kernels::blocked_attention_fwd", _backward,
                                setup_context=_setup_context)


def blocked_attention_op(q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, kv_offsets: Tensor,
                         *, params: AttentionParams, num_targets: Tensor | None = None,
                         block_q: int | None = None, block_k: int | None = None,
                         bias: RelativeBias | None = None) -> Tensor:
    """:func:`~gem_kernels.attention.blocked_tiles.blocked_attention` through the custom op
    (what a compiled call runs; it works eagerly too). The inputs are validated when the op runs,
    not while it is traced: the checks read tensor values."""
    if bias is not None and not isinstance(bias, RelativeBias):
        raise TypeError(f"bias must be a RelativeBias, got {type(bias).__name__}")
    return torch.ops.gem_kernels.blocked_attention_fwd(
        q, k, v, q_offsets, kv_offsets, num_targets,
        None if bias is None else bias.position_weights,
        None if bias is None else bias.time_weights,
        None if bias is None else bias.timestamps,
        params.causal, -1 if params.window is None else params.window, params.num_prefix,
        params.normalization == "silu", params.resolved_scale(q.shape[-1]), block_q or 0,
        block_k or 0, 1.0 if bias is None else bias.time_bucket_divisor)
