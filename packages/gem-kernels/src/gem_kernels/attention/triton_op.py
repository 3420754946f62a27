"""The Triton kernels as ``torch.library`` custom ops with autograd, so they compose with autograd
and ``torch.compile`` (the compiler sees one opaque op with a fake implementation for shapes).

``gem_kernels::jagged_attention_fwd`` returns ``(out, lse)``; ``lse`` (fp32, per query and head)
is what the softmax backward needs and is not differentiable. ``gem_kernels::jagged_attention_bwd``
returns ``(dq, dk, dv)``. Registering the ops happens when this module is imported, which only the
lazy ``load`` of the ``triton`` backend does. In eager mode :func:`jagged_attention` runs the same
launch functions through a plain ``autograd.Function``, which costs far less host time per call.

The relative bias travels as trailing optional arguments of both ops: ``bias_weights``, one fp32
``(heads, num_position_buckets + num_time_buckets)`` table (position weights, then time weights),
``timestamps`` (int64, one per query token, or None without time weights),
``num_position_buckets`` (0: no bias) and ``time_divisor``. The backward op then returns a fourth
tensor, the gradient of that table (an empty tensor without a bias).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from gem_kernels.attention import triton_kernels as kernels
from gem_kernels.attention.launch_settings import BackwardLaunch, check_backward_launch

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
NUM_WARPS = 4


def kernels_are_interpreted() -> bool:
    """True when triton was imported with TRITON_INTERPRET=1 (kernels run as numpy on the CPU).

    Triton decides when ``@triton.jit`` runs; the kernel object's class says what it decided. The
    class is checked by name so this works across triton versions (3.6 on the GPU image).
    """
    return type(kernels.jagged_attention_fwd_kernel).__name__ == "InterpretedFunction"


def check_device(t: Tensor) -> None:
    """Raise unless the kernels can run on ``t``'s device; never fall back to another backend."""
    if t.device.type == "cuda" and not kernels_are_interpreted():
        return
    if t.device.type == "cpu" and kernels_are_interpreted():
        return
    if t.device.type == "cpu":
        raise RuntimeError(
            "the triton attention backend got CPU tensors but triton kernels run on CPU only "
            "under the interpreter: set TRITON_INTERPRET=1 before anything imports triton (slow, "
            "for tests), or choose an attention backend that runs on cpu (gem plugins lists "
            "each one's devices)"
        )
    raise RuntimeError(
        f"the triton attention backend cannot run on {t.device}: it needs CUDA tensors (or CPU "
        "tensors with TRITON_INTERPRET=1)"
    )


def _dot_config(dtype: torch.dtype) -> tuple[tl.dtype, str]:
    # The interpreter computes bf16/fp16 on raw bits, so every dot runs in fp32 there. On a GPU,
    # 16-bit operands go to the tensor cores as they are; fp32 stays exact ("ieee", not tf32).
    if kernels_are_interpreted() or dtype == torch.float32:
        return tl.float32, "ieee"
    return _TL_DTYPES[dtype], "ieee"


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _constexprs(q: Tensor, is_self: bool, causal: bool, window: int, silu: bool,
                block_m: int, block_n: int, num_warps: int | None = None,
                num_stages: int | None = None) -> dict:
    dot_dtype, precision = _dot_config(q.dtype)
    meta = dict(
        IS_SELF=is_self, CAUSAL=causal, HAS_WINDOW=window >= 0, SILU=silu,
        DOT_DTYPE=dot_dtype, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=_block_d(q.shape[-1]), num_warps=num_warps or NUM_WARPS,
    )
    if num_stages is not None:  # else triton's default software pipelining depth
        meta["num_stages"] = num_stages
    return meta


def _bias_args(bias_weights: Tensor | None, timestamps: Tensor | None,
               num_position_buckets: int, time_divisor: float, lse: Tensor,
               offsets: Tensor) -> tuple:
    """The kernels' bias arguments ``(BIAS_W, TS, stride_bwh, num_pb, num_tb, time_divisor)``;
    without a bias, ``num_pb = 0`` and unused stand-ins of the same pointer types (fp32, int64),
    so calls with and without a bias share one compiled kernel."""
    if bias_weights is None or num_position_buckets <= 0:
        return lse, offsets, 0, 0, 0, 1.0
    if bias_weights.dtype != torch.float32 or bias_weights.stride(-1) != 1:
        raise ValueError("bias_weights must be a float32 table with contiguous rows")
    num_tb = bias_weights.shape[1] - num_position_buckets
    if num_tb < 0 or (num_tb > 0) != (timestamps is not None):
        raise ValueError(f"bias_weights has {bias_weights.shape[1]} columns for "
                         f"{num_position_buckets} position buckets; time buckets need timestamps")
    ts = timestamps.to(torch.int64).contiguous() if timestamps is not None else offsets
    return (bias_weights, ts, bias_weights.stride(0), num_position_buckets, num_tb,
            float(time_divisor))


def _forward(
    q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, kv_offsets: Tensor, num_targets: Tensor,
    is_self: bool, causal: bool, window: int, num_prefix: int, silu: bool, scale: float,
    max_q_len: int, max_kv_len: int, block_m: int, block_n: int, *,
    num_warps: int | None = None, num_stages: int | None = None,
    bias_weights: Tensor | None = None, timestamps: Tensor | None = None,
    num_position_buckets: int = 0, time_divisor: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Launch the forward kernel. The keyword-only launch settings are for tuning tools
    (``gem_kernels.bench.gpu_tune``); the ops use the defaults. The bias arguments are described
    in the module docstring."""
    check_device(q)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    batch, heads = q_offsets.numel() - 1, q.shape[1]
    grid = (triton.cdiv(max_q_len, block_m), batch, heads)
    if q.shape[0] == 0 or grid[0] == 0 or batch == 0:
        out.zero_()
        return out, lse.zero_()
    kernels.jagged_attention_fwd_kernel[grid](
        q, k, v, out, lse, q_offsets, kv_offsets, num_targets,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        scale, num_prefix, max(window, 0), q.shape[-1],
        *_bias_args(bias_weights, timestamps, num_position_buckets, time_divisor, lse,
                    q_offsets),
        **_constexprs(q, is_self, causal, window, silu, block_m, block_n, num_warps,
                      num_stages),
    )
    return out, lse


@torch.library.custom_op("gem_kernels::jagged_attention_fwd", mutates_args=())
def jagged_attention_fwd(
    q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, kv_offsets: Tensor, num_targets: Tensor,
    is_self: bool, causal: bool, window: int, num_prefix: int, silu: bool, scale: float,
    max_q_len: int, max_kv_len: int, block_m: int, block_n: int,
    bias_weights: Tensor | None = None, timestamps: Tensor | None = None,
    num_position_buckets: int = 0, time_divisor: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Jagged attention forward. ``window < 0`` means no window. Inputs must be contiguous."""
    return _forward(q, k, v, q_offsets, kv_offsets, num_targets, is_self, causal, window,
                    num_prefix, silu, scale, max_q_len, max_kv_len, block_m, block_n,
                    bias_weights=bias_weights, timestamps=timestamps,
                    num_position_buckets=num_position_buckets, time_divisor=time_divisor)


@jagged_attention_fwd.register_fake
def _(q, k, v, q_offsets, kv_offsets, num_targets, is_self, causal, window, num_prefix, silu,
      scale, max_q_len, max_kv_len, block_m, block_n, bias_weights=None, timestamps=None,
      num_position_buckets=0, time_divisor=1.0):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


def _softmax_delta(out: Tensor, grad_out: Tensor, like: Tensor) -> Tensor:
    delta = torch.empty_like(like)
    block_t = 32
    kernels.softmax_delta_kernel[(triton.cdiv(out.shape[0], block_t), out.shape[1])](
        out, grad_out, delta, out.shape[0], out.stride(0), out.stride(1), grad_out.stride(0),
        grad_out.stride(1), delta.stride(0), delta.stride(1), out.shape[-1],
        BLOCK_T=block_t, BLOCK_D=_block_d(out.shape[-1]), num_warps=NUM_WARPS,
    )
    return delta


def _backward_kernels(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    q_offsets: Tensor, kv_offsets: Tensor, num_targets: Tensor,
    is_self: bool, causal: bool, window: int, num_prefix: int, silu: bool, scale: float,
    max_q_len: int, max_kv_len: int, block_m: int, block_n: int, *,
    dkdv_blocks: tuple[int, int] | None = None, dq_blocks: tuple[int, int] | None = None,
    num_warps: int | None = None, num_stages: int | None = None,
    bias_weights: Tensor | None = None, timestamps: Tensor | None = None,
    num_position_buckets: int = 0, time_divisor: float = 1.0, allow_known_wrong: bool = False,
) -> tuple[Tensor, ...]:
    """Launch the backward kernels. ``dkdv_blocks``/``dq_blocks`` (query tile, key tile) of
    each kernel default to ``(block_m, block_n)``; like the launch settings they are for tuning
    tools. Settings measured wrong on a GPU are refused there
    (:func:`~gem_kernels.attention.launch_settings.check_backward_launch`; ``allow_known_wrong``
    lets the tuning tool measure them). Returns ``(dq, dk, dv)``, and the fp32 gradient of
    ``bias_weights`` fourth when a bias is given (``num_position_buckets > 0``)."""
    check_device(q)
    dkdv_m, dkdv_n = dkdv_blocks or (block_m, block_n)
    dq_m, dq_n = dq_blocks or (block_m, block_n)
    check_backward_launch(
        BackwardLaunch(dkdv_blocks=(dkdv_m, dkdv_n), dq_blocks=(dq_m, dq_n),
                       num_warps=num_warps or NUM_WARPS, num_stages=num_stages),
        device_type=q.device.type, interpreted=kernels_are_interpreted(),
        allow_known_wrong=allow_known_wrong)
    batch, heads = q_offsets.numel() - 1, q.shape[1]
    has_bias = bias_weights is not None and num_position_buckets > 0
    dbias = (torch.zeros(bias_weights.shape, dtype=torch.float32, device=q.device) if has_bias
             else None)
    if q.shape[0] == 0 or k.shape[0] == 0 or batch == 0:
        grads = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        return grads + (dbias,) if has_bias else grads
    # Every row of every sample is stored by the program of its block (zeros where a row sees
    # nothing), so no memset is needed first.
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    # delta = rowsum(dO * O) of the softmax backward, in fp32. SiLU never reads it: the kernels
    # get an uninitialised buffer of the right shape.
    delta = torch.empty_like(lse) if silu else _softmax_delta(out, grad_out, lse)
    dkdv_meta = _constexprs(q, is_self, causal, window, silu, dkdv_m, dkdv_n, num_warps,
                            num_stages)
    dq_meta = _constexprs(q, is_self, causal, window, silu, dq_m, dq_n, num_warps, num_stages)
    common = (scale, num_prefix, max(window, 0), q.shape[-1],
              *_bias_args(bias_weights, timestamps, num_position_buckets, time_divisor, lse,
                          q_offsets))
    # The dQ kernel sums the bias gradient into this fp32 buffer (a stand-in without a bias).
    dw_part = dbias if has_bias else lse
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               grad_out.stride(0), grad_out.stride(1), lse.stride(0), lse.stride(1))
    kernels.jagged_attention_bwd_dkdv_kernel[(triton.cdiv(max_kv_len, dkdv_n), batch, heads)](
        q, k, v, grad_out, lse, delta, dk, dv, q_offsets, kv_offsets, num_targets,
        *strides, dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), *common, **dkdv_meta,
    )
    kernels.jagged_attention_bwd_dq_kernel[(triton.cdiv(max_q_len, dq_m), batch, heads)](
        q, k, v, grad_out, lse, delta, dq, q_offsets, kv_offsets, num_targets,
        *strides, dq.stride(0), dq.stride(1), *common, dw_part, dw_part.stride(0), **dq_meta,
    )
    return (dq, dk, dv, dbias) if has_bias else (dq, dk, dv)


@torch.library.custom_op("gem_kernels::jagged_attention_bwd", mutates_args=())
def jagged_attention_bwd(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    q_offsets: Tensor, kv_offsets: Tensor, num_targets: Tensor,
    is_self: bool, causal: bool, window: int, num_prefix: int, silu: bool, scale: float,
    max_q_len: int, max_kv_len: int, block_m: int, block_n: int,
    bias_weights: Tensor | None = None, timestamps: Tensor | None = None,
    num_position_buckets: int = 0, time_divisor: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of q, k, v: one kernel per key block for dK/dV, one per query block for dQ (no
    atomics, so they are deterministic); and of ``bias_weights`` (atomic fp32 sums in the dQ
    kernel; an empty tensor without a bias)."""
    grads = _backward_kernels(grad_out, q, k, v, out, lse, q_offsets, kv_offsets, num_targets,
                              is_self, causal, window, num_prefix, silu, scale, max_q_len,
                              max_kv_len, block_m, block_n, bias_weights=bias_weights,
                              timestamps=timestamps, num_position_buckets=num_position_buckets,
                              time_divisor=time_divisor)
    if len(grads) == 3:
        grads = grads + (q.new_empty((0,), dtype=torch.float32),)
    return grads


@jagged_attention_bwd.register_fake
def _(grad_out, q, k, v, out, lse, q_offsets, kv_offsets, num_targets, is_self, causal, window,
      num_prefix, silu, scale, max_q_len, max_kv_len, block_m, block_n, bias_weights=None,
      timestamps=None, num_position_buckets=0, time_divisor=1.0):
    dbias = (q.new_empty((0,), dtype=torch.float32)
             if bias_weights is None or num_position_buckets <= 0
             else bias_weights.new_empty(bias_weights.shape, dtype=torch.float32))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dbias


# Positions in the ops' argument lists.
_NUM_OPTIONS = 10  # is_self ... block_n
_BIAS_AT = 6 + _NUM_OPTIONS  # bias_weights, timestamps, num_position_buckets, time_divisor


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, q_offsets, kv_offsets, num_targets = inputs[:6]
    options = tuple(inputs[6:_BIAS_AT])
    bias_weights, timestamps, num_pb, time_divisor = (tuple(inputs[_BIAS_AT:])
                                                      + (None, None, 0, 1.0)[len(inputs)
                                                                             - _BIAS_AT:])
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, q_offsets, kv_offsets, num_targets, bias_weights,
                          timestamps)
    ctx.options = options
    ctx.bias_options = (num_pb, time_divisor)
    ctx.num_inputs = len(inputs)


def _backward(ctx, grad_out: Tensor, grad_lse: Tensor | None):
    q, k, v, out, lse, q_offsets, kv_offsets, num_targets, bias_weights, timestamps = (
        ctx.saved_tensors)
    dq, dk, dv, dbias = torch.ops.gem_kernels.jagged_attention_bwd(
        grad_out.contiguous(), q, k, v, out, lse, q_offsets, kv_offsets, num_targets,
        *ctx.options, bias_weights, timestamps, *ctx.bias_options,
    )
    grads = [dq, dk, dv] + [None] * (ctx.num_inputs - 3)
    if bias_weights is not None and ctx.num_inputs > _BIAS_AT:
        grads[_BIAS_AT] = dbias
    return tuple(grads)


torch.library.register_autograd(
    "gem_kernels::jagged_attention_fwd", _backward, setup_context=_setup_context
)


class _EagerJaggedAttention(torch.autograd.Function):
    """The same kernels as the custom ops, for eager mode: a ``torch.library`` custom op with
    autograd costs about ten times the host time of an ``autograd.Function`` per call (measured
    300 us against 29 us on this project's CPU machine), which leaves a GPU idle on short
    attention calls such as PMA and cross-attention."""

    @staticmethod
    def forward(ctx, q, k, v, q_offsets, kv_offsets, num_targets, bias_weights, timestamps,
                num_position_buckets, time_divisor, backward_launch, *options):
        bias = dict(bias_weights=bias_weights, timestamps=timestamps,
                    num_position_buckets=num_position_buckets, time_divisor=time_divisor)
        out, lse = _forward(q, k, v, q_offsets, kv_offsets, num_targets, *options, **bias)
        ctx.save_for_backward(q, k, v, out, lse, q_offsets, kv_offsets, num_targets, bias_weights,
                              timestamps)
        ctx.options = options
        ctx.bias_options = (num_position_buckets, time_divisor)
        ctx.backward_launch = backward_launch
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, q_offsets, kv_offsets, num_targets, bias_weights, timestamps = (
            ctx.saved_tensors)
        num_position_buckets, time_divisor = ctx.bias_options
        launch = ctx.backward_launch
        settings = {} if launch is None else dict(
            dkdv_blocks=launch.dkdv_blocks, dq_blocks=launch.dq_blocks,
            num_warps=launch.num_warps, num_stages=launch.num_stages)
        grads = _backward_kernels(grad_out.contiguous(), q, k, v, out, lse, q_offsets,
                                  kv_offsets, num_targets, *ctx.options,
                                  bias_weights=bias_weights, timestamps=timestamps,
                                  num_position_buckets=num_position_buckets,
                                  time_divisor=time_divisor, **settings)
        dbias = grads[3] if len(grads) == 4 else None
        return (grads[:3] + (None, None, None, dbias, None, None, None, None)
                + (None,) * len(ctx.options))


def jagged_attention(q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, kv_offsets: Tensor,
                     num_targets: Tensor, *options, bias_weights: Tensor | None = None,
                     timestamps: Tensor | None = None, num_position_buckets: int = 0,
                     time_divisor: float = 1.0,
                     backward_launch: BackwardLaunch | None = None) -> Tensor:
    """The attention output, differentiable in q, k, v (and ``bias_weights``): the custom op
    while ``torch.compile`` traces (one opaque node with a fake implementation), the autograd
    Function otherwise. ``options`` are the ten scalars ``is_self`` ... ``block_n``;
    ``backward_launch`` (eager mode only) the backward kernels' launch settings."""
    if torch.compiler.is_compiling():
        if backward_launch is not None:
            raise ValueError("triton attention: backward launch settings are a tuning knob of "
                             "eager mode; under torch.compile the default launch runs")
        return torch.ops.gem_kernels.jagged_attention_fwd(
            q, k, v, q_offsets, kv_offsets, num_targets, *options, bias_weights, timestamps,
            num_position_buckets, time_divisor)[0]
    return _EagerJaggedAttention.apply(q, k, v, q_offsets, kv_offsets, num_targets, bias_weights,
                                       timestamps, num_position_buckets, time_divisor,
                                       backward_launch, *options)
