"""Triton kernels of the gated norm: ``out = (xhat * w + b) * gate`` with ``xhat`` the
LayerNorm (centred) or RMSNorm (not centred) of each row. Statistics and math in fp32.

One program handles ``BLOCK_ROWS`` whole rows (``BLOCK_D`` >= the row width), so a row is read
once. The backward writes per-program partial sums of dW and dB; the caller adds them up (no
atomics, deterministic).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rows(X, stride, row0, n_rows, n_cols, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = row0 + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    offsets = rows[:, None] * stride + cols[None, :]
    return rows, cols, mask, offsets


@triton.jit
def gated_norm_fwd_kernel(
    X, G, W, B, OUT, MEAN, RSTD, stride, n_rows, n_cols, eps,
    RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row0 = tl.program_id(0) * BLOCK_ROWS
    rows, cols, mask, offsets = _rows(X, stride, row0, n_rows, n_cols, BLOCK_ROWS, BLOCK_D)
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(G + offsets, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    if RMS:
        mean = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        centred = x
    else:
        mean = tl.sum(x, 1) / n_cols
        centred = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, 1) / n_cols + eps)
    y = centred * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(B + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + offsets, (y * gate).to(OUT.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean, mask=rows < n_rows)
    tl.store(RSTD + rows, rstd, mask=rows < n_rows)


@triton.jit
def gated_norm_bwd_kernel(
    X, G, W, B, DOUT, MEAN, RSTD, DX, DG, DW_PART, DB_PART, stride, n_rows, n_cols,
    RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    row0 = pid * BLOCK_ROWS
    rows, cols, mask, offsets = _rows(X, stride, row0, n_rows, n_cols, BLOCK_ROWS, BLOCK_D)
    col_ok = cols < n_cols
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(G + offsets, mask=mask, other=0.0).to(tl.float32)
    dout = tl.load(DOUT + offsets, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    mean = tl.load(MEAN + rows, mask=rows < n_rows, other=0.0)
    rstd = tl.load(RSTD + rows, mask=rows < n_rows, other=0.0)
    xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    y = xhat * w[None, :]
    if HAS_BIAS:
        y += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dg = dout * y
    dy = dout * gate
    dxhat = dy * w[None, :]
    # d/dx of xhat: rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)); RMS has no mean term.
    proj = tl.sum(dxhat * xhat, 1) / n_cols
    dx = dxhat - xhat * proj[:, None]
    if not RMS:
        dx -= (tl.sum(dxhat, 1) / n_cols)[:, None]
    dx = tl.where(mask, dx * rstd[:, None], 0.0)
    tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DG + offsets, dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(DW_PART + pid * n_cols + cols, tl.sum(dy * xhat, 0), mask=col_ok)
    if HAS_BIAS:
        tl.store(DB_PART + pid * n_cols + cols, tl.sum(dy, 0), mask=col_ok)
