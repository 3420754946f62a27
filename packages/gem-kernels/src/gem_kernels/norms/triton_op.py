"""The gated-norm kernels as ``torch.library`` custom ops with autograd (what ``torch.compile``
sees), the same launches in a plain ``autograd.Function`` for eager mode, and the public function.

``gated_norm(x, gate, weight, bias, kind=..., eps=...)`` equals
:func:`gem_core.norm.gated_norm_reference`; ``x`` and ``gate`` are ``(..., D)``.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from gem_kernels.attention.triton_op import check_device
from gem_kernels.norms import triton_kernels as kernels

BLOCK_ROWS = 16
MAX_WIDTH = 16384  # one row per tile; wider rows would need a split reduction


def _launch_meta(n_rows: int, n_cols: int, rms: bool, has_bias: bool) -> tuple[tuple, dict]:
    grid = (triton.cdiv(n_rows, BLOCK_ROWS),)
    return grid, dict(RMS=rms, HAS_BIAS=has_bias, BLOCK_ROWS=BLOCK_ROWS,
                      BLOCK_D=max(16, triton.next_power_of_2(n_cols)))


def _forward(x: Tensor, gate: Tensor, weight: Tensor, bias: Tensor | None, rms: bool,
             eps: float) -> tuple[Tensor, Tensor, Tensor]:
    check_device(x)
    n_rows, n_cols = x.shape
    out = torch.empty_like(x)
    mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows:
        grid, meta = _launch_meta(n_rows, n_cols, rms, bias is not None)
        kernels.gated_norm_fwd_kernel[grid](
            x, gate, weight, bias if bias is not None else weight, out, mean, rstd,
            x.stride(0), n_rows, n_cols, eps, **meta,
        )
    return out, mean, rstd


@torch.library.custom_op("gem_kernels::gated_norm_fwd", mutates_args=())
def gated_norm_fwd(x: Tensor, gate: Tensor, weight: Tensor, bias: Tensor | None, rms: bool,
                   eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, mean, rstd)`` for 2-D contiguous ``x`` and ``gate``."""
    return _forward(x, gate, weight, bias, rms, eps)


@gated_norm_fwd.register_fake
def _(x, gate, weight, bias, rms, eps):
    n_rows = x.shape[0]
    return (torch.empty_like(x), x.new_empty(n_rows, dtype=torch.float32),
            x.new_empty(n_rows, dtype=torch.float32))


def _backward_kernels(grad_out: Tensor, x: Tensor, gate: Tensor, weight: Tensor,
                      bias: Tensor | None, mean: Tensor, rstd: Tensor, rms: bool
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    check_device(x)
    n_rows, n_cols = x.shape
    dx, dgate = torch.empty_like(x), torch.empty_like(gate)
    grid, meta = _launch_meta(n_rows, n_cols, rms, bias is not None)
    dw_part = torch.zeros(grid[0], n_cols, dtype=torch.float32, device=x.device)
    db_part = torch.zeros_like(dw_part) if bias is not None else dw_part
    if n_rows:
        kernels.gated_norm_bwd_kernel[grid](
            x, gate, weight, bias if bias is not None else weight, grad_out, mean, rstd,
            dx, dgate, dw_part, db_part, x.stride(0), n_rows, n_cols, **meta,
        )
    dweight = dw_part.sum(0).to(weight.dtype)
    dbias = db_part.sum(0).to(bias.dtype) if bias is not None else weight.new_empty(0)
    return dx, dgate, dweight, dbias


@torch.library.custom_op("gem_kernels::gated_norm_bwd", mutates_args=())
def gated_norm_bwd(grad_out: Tensor, x: Tensor, gate: Tensor, weight: Tensor,
                   bias: Tensor | None, mean: Tensor, rstd: Tensor, rms: bool
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dgate, dweight, dbias)``; ``dbias`` is empty when there is no bias."""
    return _backward_kernels(grad_out, x, gate, weight, bias, mean, rstd, rms)


@gated_norm_bwd.register_fake
def _(grad_out, x, gate, weight, bias, mean, rstd, rms):
    return (torch.empty_like(x), torch.empty_like(gate), torch.empty_like(weight),
            torch.empty_like(bias) if bias is not None else weight.new_empty(0))


def _setup_context(ctx, inputs, output) -> None:
    x, gate, weight, bias, rms, eps = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.has_bias = bias is not None
    ctx.rms = rms
    ctx.save_for_backward(x, gate, weight, bias, mean, rstd)


def _backward(ctx, grad_out, grad_mean, grad_rstd):
    x, gate, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dgate, dweight, dbias = torch.ops.gem_kernels.gated_norm_bwd(
        grad_out.contiguous(), x, gate, weight, bias, mean, rstd, ctx.rms
    )
    return dx, dgate, dweight, dbias if ctx.has_bias else None, None, None


torch.library.register_autograd("gem_kernels::gated_norm_fwd", _backward,
                                setup_context=_setup_context)


class _EagerGatedNorm(torch.autograd.Function):
    """The custom ops' kernels for eager mode, without the custom-op dispatch cost (see
    :class:`gem_kernels.attention.triton_op._EagerJaggedAttention`)."""

    @staticmethod
    def forward(ctx, x, gate, weight, bias, rms, eps):
        out, mean, rstd = _forward(x, gate, weight, bias, rms, eps)
        ctx.has_bias, ctx.rms = bias is not None, rms
        ctx.save_for_backward(x, gate, weight, bias, mean, rstd)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, gate, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dgate, dweight, dbias = _backward_kernels(grad_out.contiguous(), x, gate, weight,
                                                      bias, mean, rstd, ctx.rms)
        return dx, dgate, dweight, dbias if ctx.has_bias else None, None, None


def gated_norm(x: Tensor, gate: Tensor, weight: Tensor, bias: Tensor | None = None, *,
               kind: str = "layer", eps: float = 1e-5) -> Tensor:
    """Fused ``(norm(x) * weight + bias) * gate`` over the last dimension."""
    if kind not in ("layer", "rms"):
        raise ValueError(f"unknown norm kind {kind!r}; use 'layer' or 'rms'")
    if x.shape != gate.shape or weight.shape != x.shape[-1:] or (
            bias is not None and bias.shape != weight.shape):
        raise ValueError(f"gated_norm: x {tuple(x.shape)}, gate {tuple(gate.shape)}, weight "
                         f"{tuple(weight.shape)} and bias disagree")
    if x.shape[-1] > MAX_WIDTH:
        raise ValueError(f"gated_norm supports rows up to {MAX_WIDTH} wide, got {x.shape[-1]}")
    shape = x.shape
    args = (x.reshape(-1, shape[-1]).contiguous(), gate.reshape(-1, shape[-1]).contiguous(),
            weight.contiguous(), None if bias is None else bias.contiguous(), kind == "rms", eps)
    if torch.compiler.is_compiling():  # one opaque op for the compiler
        out = gated_norm_fwd(*args)[0]
    else:
        out = _EagerGatedNorm.apply(*args)
    return out.reshape(shape)
