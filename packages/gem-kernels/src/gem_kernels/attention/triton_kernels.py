"""Triton kernels of jagged attention: forward, backward dK/dV, backward dQ.

One program handles one (block, sample, head). Programs whose block lies past the end of their
sample exit at once, so the grid is sized from ``max_len`` without a device sync.

Which keys a query block needs (and which queries a key block is seen by) is a union of at most
three disjoint index ranges (contextual prefix, the causal/window band, the target diagonal); the
kernels loop over those ranges only, so blocks outside the window or above the causal diagonal are
never loaded. Inside a tile the exact mask of :mod:`gem_core.attention.masks` is applied element
by element, so a range only has to be a superset of what is visible, never exact.

The relative bias (:mod:`gem_core.attention.relative_bias`, self-attention only) is one fp32
table ``BIAS_W`` of ``(heads, num_pb + num_tb)``: position weights then time weights. It is added
to the scores of every tile (:func:`_relative_bias`) when ``num_pb > 0``, a runtime branch, so
calls with and without a bias share one compiled kernel. Its gradient, the sum of dL/dS over the
pairs of each bucket, is accumulated by the dQ kernel with atomic adds into the fp32 buffer
``DW_PART`` (zeroed by the caller), so that gradient is not bitwise deterministic.

Accumulation is fp32. ``DOT_DTYPE`` is the dtype of the ``tl.dot`` operands: the input dtype on a
GPU (tensor cores) and fp32 in the interpreter, which computes bf16 on raw bits (inexactly).
"""

from __future__ import annotations

import triton
import triton.language as tl

# A finite "minus infinity" for the running max, so a tile whose keys are all masked for a row
# gives exp(-inf - finite) = 0 instead of exp(-inf + inf) = NaN.
_NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _visible(offs_m, offs_n, history, prefix, window,
             IS_SELF: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """``mask[i, j]`` of gem_core.attention.masks for query rows ``offs_m`` and keys ``offs_n``."""
    i = offs_m[:, None]
    j = offs_n[None, :]
    ok = (i >= 0) & (j >= 0)
    if IS_SELF:
        pos = tl.minimum(i, history)  # a target query sits just after the history
        if CAUSAL:
            ok = ok & (j <= pos)
        if HAS_WINDOW:
            if CAUSAL:
                ok = ok & (pos - j <= window)
            else:
                ok = ok & (tl.abs(pos - j) <= window)
        ok = ok | ((j < history) & ((j < prefix) | (i < tl.minimum(prefix, history))))
        ok = tl.where(j >= history, i == j, ok)
    return ok


@triton.jit
def _key_ranges(m0, m1, kv_len, history, prefix, window,
                IS_SELF: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Three disjoint key ranges covering every key visible to queries ``[m0, m1)``."""
    if IS_SELF:
        pe = tl.minimum(prefix, history)
        pos_lo = tl.minimum(m0, history)
        pos_hi = tl.minimum(m1 - 1, history)
        lo = pos_lo * 0
        if HAS_WINDOW:
            lo = tl.maximum(pos_lo - window, 0)
        hi = pos_hi * 0 + history
        if CAUSAL:
            hi = tl.minimum(pos_hi + 1, history)
        elif HAS_WINDOW:
            hi = tl.minimum(pos_hi + window + 1, history)
        # A prefix query sees the whole history.
        has_prefix_query = m0 < pe
        lo = tl.where(has_prefix_query, 0, lo)
        hi = tl.where(has_prefix_query, history, hi)
        a0 = pe * 0
        b0 = pe
        a1 = tl.maximum(lo, pe)
        b1 = hi
        a2 = tl.maximum(m0, history)
        b2 = m1
    else:
        a0 = kv_len * 0
        b0 = kv_len * 0
        a1 = kv_len * 0
        b1 = kv_len
        a2 = kv_len * 0
        b2 = kv_len * 0
    return a0, b0, a1, b1, a2, b2


@triton.jit
def _query_ranges(n0, n1, q_len, history, prefix, window,
                  IS_SELF: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Three disjoint query ranges covering every query that sees a key of ``[n0, n1)``."""
    if IS_SELF:
        pe = tl.minimum(prefix, history)
        has_hist = n0 < history
        jhi = tl.minimum(n1, history) - 1
        qlo = n0 * 0
        if CAUSAL:
            qlo = n0
        elif HAS_WINDOW:
            qlo = tl.maximum(n0 - window, 0)
        qhi = jhi * 0 + history
        targets_see = has_hist
        if HAS_WINDOW:
            qhi = tl.minimum(jhi + window + 1, history)
            targets_see = has_hist & (history - jhi <= window)
        a0 = n0 * 0
        b0 = tl.where(has_hist, pe, 0)
        a1 = tl.maximum(qlo, pe)
        b1 = tl.where(has_hist, qhi, 0)
        a2 = tl.where(targets_see, history, tl.maximum(n0, history))
        b2 = tl.where(targets_see, q_len, n1)
        # A block holding a prefix key is seen by every query.
        has_prefix_key = n0 < pe
        b0 = tl.where(has_prefix_key, 0, b0)
        a1 = tl.where(has_prefix_key, 0, a1)
        b1 = tl.where(has_prefix_key, q_len, b1)
        a2 = tl.where(has_prefix_key, 0, a2)
        b2 = tl.where(has_prefix_key, 0, b2)
    else:
        a0 = q_len * 0
        b0 = q_len * 0
        a1 = q_len * 0
        b1 = q_len
        a2 = q_len * 0
        b2 = q_len * 0
    return a0, b0, a1, b1, a2, b2


@triton.jit
def _relative_bias(offs_m, offs_n, row_ok, col_ok, history, w_base, ts_base, num_pb, num_tb,
                   time_divisor):
    """The bias of gem_core.attention.relative_bias for one tile, and the column of ``w_base``
    (one head's row of the weight table) of its position and time buckets: position bucket
    ``min(|pos(i) - pos(j)|, num_pb - 1)`` with ``pos(x) = min(x, history)``, time bucket
    ``min(floor(ln(max(1, |ts_i - ts_j|)) / time_divisor), num_tb - 1)`` in float32."""
    pos_m = tl.minimum(offs_m, history)
    pos_n = tl.minimum(offs_n, history)
    p_col = tl.minimum(tl.abs(pos_m[:, None] - pos_n[None, :]), num_pb - 1)
    ok = row_ok[:, None] & col_ok[None, :]
    bias = tl.load(w_base + p_col, mask=ok, other=0.0).to(tl.float32)
    t_col = p_col
    if num_tb > 0:
        t_m = tl.load(ts_base + offs_m, mask=row_ok, other=0)
        t_n = tl.load(ts_base + offs_n, mask=col_ok, other=0)
        dt = tl.maximum(tl.abs(t_m[:, None] - t_n[None, :]), 1).to(tl.float32)
        # log(dt) >= 0, so the conversion (which truncates) is the floor.
        t_col = num_pb + tl.minimum((tl.log(dt) / time_divisor).to(tl.int32), num_tb - 1)
        bias += tl.load(w_base + t_col, mask=ok, other=0.0).to(tl.float32)
    return bias, p_col, t_col


@triton.jit
def _sample(offsets, nt, b, IS_SELF: tl.constexpr):
    """Start (int64), length and history length (int32) of sample ``b``."""
    start = tl.load(offsets + b)
    length = (tl.load(offsets + b + 1) - start).to(tl.int32)
    history = length
    if IS_SELF:
        history = length - tl.load(nt + b).to(tl.int32)
    return start, length, history


# ---------------------------------------------------------------------------------------------
# Forward.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _fwd_range(acc, m_i, l_i, q, offs_m, row_ok, k_base, v_base, stride_kt, stride_vt,
               a, b, history, prefix, window, scale, offs_d, d_ok,
               w_base, ts_base, num_pb, num_tb, time_divisor,
               IS_SELF: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
               SILU: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
               BLOCK_N: tl.constexpr):
    for n0 in range(a, b, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        col_ok = offs_n < b
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :], mask=kv_mask,
                    other=0.0).to(DOT_DTYPE)
        v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :], mask=kv_mask,
                    other=0.0).to(DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if num_pb > 0:
            bias, p_col, t_col = _relative_bias(offs_m, offs_n, row_ok, col_ok, history, w_base,
                                                ts_base, num_pb, num_tb, time_divisor)
            s += bias
        mask = _visible(offs_m, offs_n, history, prefix, window, IS_SELF, CAUSAL, HAS_WINDOW)
        mask = mask & row_ok[:, None] & col_ok[None, :]
        if SILU:
            p = tl.where(mask, s * tl.sigmoid(s), 0.0)
            acc += tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
        else:
            s = tl.where(mask, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
            m_i = m_new
    return acc, m_i, l_i


@triton.jit
def jagged_attention_fwd_kernel(
    Q, K, V, OUT, LSE, QOff, KOff, NT,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_lt, stride_lh,
    scale, prefix, window, head_dim,
    BIAS_W, TS, stride_bwh, num_pb, num_tb, time_divisor,
    IS_SELF: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, SILU: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_start, q_len, history = _sample(QOff, NT, b, IS_SELF)
    m0 = pid_m * BLOCK_M
    if m0 >= q_len:
        return
    kv_start, kv_len, kv_history = _sample(KOff, NT, b, False)
    if not IS_SELF:
        history = kv_len
    m1 = tl.minimum(m0 + BLOCK_M, q_len)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    row_ok = offs_m < q_len
    w_base = BIAS_W + h * stride_bwh
    ts_base = TS + q_start
    q_base = Q + q_start * stride_qt + h * stride_qh
    q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)
    k_base = K + kv_start * stride_kt + h * stride_kh
    v_base = V + kv_start * stride_vt + h * stride_vh

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + _NEG_BIG
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    a0, b0, a1, b1, a2, b2 = _key_ranges(m0, m1, kv_len, history, prefix, window,
                                         IS_SELF, CAUSAL, HAS_WINDOW)
    acc, m_i, l_i = _fwd_range(acc, m_i, l_i, q, offs_m, row_ok, k_base, v_base, stride_kt,
                               stride_vt, a0, b0, history, prefix, window, scale, offs_d, d_ok,
                               w_base, ts_base, num_pb, num_tb, time_divisor,
                               IS_SELF, CAUSAL, HAS_WINDOW, SILU, DOT_DTYPE, PRECISION, BLOCK_N)
    acc, m_i, l_i = _fwd_range(acc, m_i, l_i, q, offs_m, row_ok, k_base, v_base, stride_kt,
                               stride_vt, a1, b1, history, prefix, window, scale, offs_d, d_ok,
                               w_base, ts_base, num_pb, num_tb, time_divisor,
                               IS_SELF, CAUSAL, HAS_WINDOW, SILU, DOT_DTYPE, PRECISION, BLOCK_N)
    acc, m_i, l_i = _fwd_range(acc, m_i, l_i, q, offs_m, row_ok, k_base, v_base, stride_kt,
                               stride_vt, a2, b2, history, prefix, window, scale, offs_d, d_ok,
                               w_base, ts_base, num_pb, num_tb, time_divisor,
                               IS_SELF, CAUSAL, HAS_WINDOW, SILU, DOT_DTYPE, PRECISION, BLOCK_N)
    if SILU:
        # HSTU normalisation: divide by the sample's number of keys (not the batch maximum).
        out = acc * (1.0 / tl.maximum(kv_len, 1).to(tl.float32))
        lse = tl.zeros([BLOCK_M], dtype=tl.float32)
    else:
        has_keys = l_i > 0.0
        l_safe = tl.where(has_keys, l_i, 1.0)
        out = acc / l_safe[:, None]
        lse = tl.where(has_keys, m_i + tl.log(l_safe), 0.0)
    o_ptrs = (OUT + q_start * stride_ot + h * stride_oh + offs_m[:, None] * stride_ot
              + offs_d[None, :])
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + (q_start + offs_m) * stride_lt + h * stride_lh, lse, mask=row_ok)


# ---------------------------------------------------------------------------------------------
# Backward. Softmax: dS = P * (dP - delta), delta = rowsum(dO * O). SiLU: dS = dP * silu'(s) / n.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _probs_and_dscores(s, mask, lse, delta, dp, inv_n, SILU: tl.constexpr):
    """P and dL/dS (before the ``scale`` of dS/dq) for one tile."""
    if SILU:
        sig = tl.sigmoid(s)
        p = tl.where(mask, s * sig * inv_n, 0.0)
        ds = tl.where(mask, dp * sig * (1.0 + s * (1.0 - sig)) * inv_n, 0.0)
    else:
        p = tl.where(mask, tl.exp(s - lse[:, None]), 0.0)
        ds = p * (dp - delta[:, None])
    return p, ds


@triton.jit
def _dkdv_range(dk, dv, k, v, offs_n, col_ok, q_base, do_base, lse_base, delta_base,
                stride_qt, stride_dot, stride_lt, a, b, history, prefix, window, scale, inv_n,
                offs_d, d_ok, w_base, ts_base, num_pb, num_tb, time_divisor,
                IS_SELF: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                SILU: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr):
    for m0 in range(a, b, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        row_ok = offs_m < b
        q_mask = row_ok[:, None] & d_ok[None, :]
        q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :], mask=q_mask,
                    other=0.0).to(DOT_DTYPE)
        do = tl.load(do_base + offs_m[:, None] * stride_dot + offs_d[None, :], mask=q_mask,
                     other=0.0).to(DOT_DTYPE)
        lse = tl.load(lse_base + offs_m * stride_lt, mask=row_ok, other=0.0)
        delta = tl.load(delta_base + offs_m * stride_lt, mask=row_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if num_pb > 0:
            bias, p_col, t_col = _relative_bias(offs_m, offs_n, row_ok, col_ok, history, w_base,
                                                ts_base, num_pb, num_tb, time_divisor)
            s += bias
        mask = _visible(offs_m, offs_n, history, prefix, window, IS_SELF, CAUSAL, HAS_WINDOW)
        mask = mask & row_ok[:, None] & col_ok[None, :]
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        p, ds = _probs_and_dscores(s, mask, lse, delta, dp, inv_n, SILU)
        dv += tl.dot(tl.trans(p.to(DOT_DTYPE)), do, input_precision=PRECISION)
        dk += tl.dot(tl.trans(ds.to(DOT_DTYPE)), q, input_precision=PRECISION)
    return dk, dv


@triton.jit
def jagged_attention_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, QOff, KOff, NT,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_lt, stride_lh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    scale, prefix, window, head_dim,
    BIAS_W, TS, stride_bwh, num_pb, num_tb, time_divisor,
    IS_SELF: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, SILU: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    kv_start, kv_len, kv_history = _sample(KOff, NT, b, False)
    n0 = pid_n * BLOCK_N
    if n0 >= kv_len:
        return
    q_start, q_len, history = _sample(QOff, NT, b, IS_SELF)
    if not IS_SELF:
        history = kv_len
    n1 = tl.minimum(n0 + BLOCK_N, kv_len)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    col_ok = offs_n < kv_len
    kv_mask = col_ok[:, None] & d_ok[None, :]
    k = tl.load(K + kv_start * stride_kt + h * stride_kh + offs_n[:, None] * stride_kt
                + offs_d[None, :], mask=kv_mask, other=0.0).to(DOT_DTYPE)
    v = tl.load(V + kv_start * stride_vt + h * stride_vh + offs_n[:, None] * stride_vt
                + offs_d[None, :], mask=kv_mask, other=0.0).to(DOT_DTYPE)
    q_base = Q + q_start * stride_qt + h * stride_qh
    do_base = DO + q_start * stride_dot + h * stride_doh
    lse_base = LSE + q_start * stride_lt + h * stride_lh
    delta_base = DELTA + q_start * stride_lt + h * stride_lh
    inv_n = 1.0 / tl.maximum(kv_len, 1).to(tl.float32)
    w_base = BIAS_W + h * stride_bwh
    ts_base = TS + q_start

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    a0, b0, a1, b1, a2, b2 = _query_ranges(n0, n1, q_len, history, prefix, window,
                                           IS_SELF, CAUSAL, HAS_WINDOW)
    dk, dv = _dkdv_range(dk, dv, k, v, offs_n, col_ok, q_base, do_base, lse_base, delta_base,
                         stride_qt, stride_dot, stride_lt, a0, b0, history, prefix, window, scale,
                         inv_n, offs_d, d_ok, w_base, ts_base, num_pb, num_tb, time_divisor,
                         IS_SELF, CAUSAL, HAS_WINDOW, SILU, DOT_DTYPE,
                         PRECISION, BLOCK_M)
    dk, dv = _dkdv_range(dk, dv, k, v, offs_n, col_ok, q_base, do_base, lse_base, delta_base,
                         stride_qt, stride_dot, stride_lt, a1, b1, history, prefix, window, scale,
                         inv_n, offs_d, d_ok, w_base, ts_base, num_pb, num_tb, time_divisor,
                         IS_SELF, CAUSAL, HAS_WINDOW, SILU, DOT_DTYPE,
                         PRECISION, BLOCK_M)
    dk, dv = _dkdv_range(dk, dv, k, v, offs_n, col_ok, q_base, do_base, lse_base, delta_base,
                         stride_qt, stride_dot, stride_lt, a2, b2, history, prefix, window, scale,
                         inv_n, offs_d, d_ok, w_base, ts_base, num_pb, num_tb, time_divisor,
                         IS_SELF, CAUSAL, HAS_WINDOW, SILU, DOT_DTYPE,
                         PRECISION, BLOCK_M)
    tl.store(DK + kv_start * stride_dkt + h * stride_dkh + offs_n[:, None] * stride_dkt
             + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + kv_start * stride_dvt + h * stride_dvh + offs_n[:, None] * stride_dvt
             + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_range(dq, q, do, lse, delta, offs_m, row_ok, k_base, v_base, stride_kt, stride_vt,
              a, b, history, prefix, window, scale, inv_n, offs_d, d_ok,
              w_base, dw_base, ts_base, num_pb, num_tb, time_divisor,
              IS_SELF: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
              SILU: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
              BLOCK_N: tl.constexpr):
    for n0 in range(a, b, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        col_ok = offs_n < b
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :], mask=kv_mask,
                    other=0.0).to(DOT_DTYPE)
        v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :], mask=kv_mask,
                    other=0.0).to(DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        p_col = offs_m[:, None] * 0 + offs_n[None, :] * 0
        t_col = p_col
        if num_pb > 0:
            bias, p_col, t_col = _relative_bias(offs_m, offs_n, row_ok, col_ok, history, w_base,
                                                ts_base, num_pb, num_tb, time_divisor)
            s += bias
        mask = _visible(offs_m, offs_n, history, prefix, window, IS_SELF, CAUSAL, HAS_WINDOW)
        mask = mask & row_ok[:, None] & col_ok[None, :]
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        p, ds = _probs_and_dscores(s, mask, lse, delta, dp, inv_n, SILU)
        dq += tl.dot(ds.to(DOT_DTYPE), k, input_precision=PRECISION)
        if num_pb > 0:
            # dL/d(bias) of a pair is dL/dS: summed into its buckets' weights.
            tl.atomic_add(dw_base + p_col, ds, mask=mask)
            if num_tb > 0:
                tl.atomic_add(dw_base + t_col, ds, mask=mask)
    return dq


@triton.jit
def jagged_attention_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, QOff, KOff, NT,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_lt, stride_lh, stride_dqt, stride_dqh,
    scale, prefix, window, head_dim,
    BIAS_W, TS, stride_bwh, num_pb, num_tb, time_divisor, DW_PART, stride_dwh,
    IS_SELF: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, SILU: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_start, q_len, history = _sample(QOff, NT, b, IS_SELF)
    m0 = pid_m * BLOCK_M
    if m0 >= q_len:
        return
    kv_start, kv_len, kv_history = _sample(KOff, NT, b, False)
    if not IS_SELF:
        history = kv_len
    m1 = tl.minimum(m0 + BLOCK_M, q_len)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    row_ok = offs_m < q_len
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + q_start * stride_qt + h * stride_qh + offs_m[:, None] * stride_qt
                + offs_d[None, :], mask=q_mask, other=0.0).to(DOT_DTYPE)
    do = tl.load(DO + q_start * stride_dot + h * stride_doh + offs_m[:, None] * stride_dot
                 + offs_d[None, :], mask=q_mask, other=0.0).to(DOT_DTYPE)
    lse = tl.load(LSE + (q_start + offs_m) * stride_lt + h * stride_lh, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + (q_start + offs_m) * stride_lt + h * stride_lh, mask=row_ok,
                    other=0.0)
    k_base = K + kv_start * stride_kt + h * stride_kh
    v_base = V + kv_start * stride_vt + h * stride_vh
    inv_n = 1.0 / tl.maximum(kv_len, 1).to(tl.float32)
    w_base = BIAS_W + h * stride_bwh
    dw_base = DW_PART + h * stride_dwh
    ts_base = TS + q_start

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    a0, b0, a1, b1, a2, b2 = _key_ranges(m0, m1, kv_len, history, prefix, window,
                                         IS_SELF, CAUSAL, HAS_WINDOW)
    dq = _dq_range(dq, q, do, lse, delta, offs_m, row_ok, k_base, v_base, stride_kt, stride_vt,
                   a0, b0, history, prefix, window, scale, inv_n, offs_d, d_ok,
                   w_base, dw_base, ts_base, num_pb, num_tb, time_divisor,
                   IS_SELF, CAUSAL, HAS_WINDOW, SILU, DOT_DTYPE, PRECISION, BLOCK_N)
    dq = _dq_range(dq, q, do, lse, delta, offs_m, row_ok, k_base, v_base, stride_kt, stride_vt,
                   a1, b1, history, prefix, window, scale, inv_n, offs_d, d_ok,
                   w_base, dw_base, ts_base, num_pb, num_tb, time_divisor,
                   IS_SELF, CAUSAL, HAS_WINDOW, SILU, DOT_DTYPE, PRECISION, BLOCK_N)
    dq = _dq_range(dq, q, do, lse, delta, offs_m, row_ok, k_base, v_base, stride_kt, stride_vt,
                   a2, b2, history, prefix, window, scale, inv_n, offs_d, d_ok,
                   w_base, dw_base, ts_base, num_pb, num_tb, time_divisor,
                   IS_SELF, CAUSAL, HAS_WINDOW, SILU, DOT_DTYPE, PRECISION, BLOCK_N)
    tl.store(DQ + q_start * stride_dqt + h * stride_dqh + offs_m[:, None] * stride_dqt
             + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)


@triton.jit
def softmax_delta_kernel(
    OUT, DO, DELTA, total, stride_ot, stride_oh, stride_dot, stride_doh, stride_lt, stride_lh,
    head_dim, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``delta[t, h] = sum_d OUT[t, h, d] * dO[t, h, d]`` in fp32, read once from the 16-bit
    tensors (in PyTorch it took two fp32 copies, a product and a sum: four passes)."""
    offs_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    t_ok = offs_t < total
    mask = t_ok[:, None] & (offs_d < head_dim)[None, :]
    o = tl.load(OUT + offs_t[:, None] * stride_ot + h * stride_oh + offs_d[None, :], mask=mask,
                other=0.0).to(tl.float32)
    do = tl.load(DO + offs_t[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=mask,
                 other=0.0).to(tl.float32)
    tl.store(DELTA + offs_t * stride_lt + h * stride_lh, tl.sum(o * do, 1), mask=t_ok)
