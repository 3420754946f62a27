"""The attention conformance suite's independent references and comparison: tolerances per
dtype, the float64 padded oracle of the relative bias, and the elementwise check that names the
failing case. Kept apart from :mod:`gem_core.testing.attention_drawing`, which draws the
cases, and :mod:`gem_core.testing.attention_checks`, which runs the backends on them."""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

from gem_core.attention.api import AttentionParams
from gem_core.attention.masks import self_attention_masks


@attrs.frozen
class Tolerance:
    """``|out - ref| <= atol * max(1, max|ref|) + rtol * |ref|``, elementwise.

    ``atol`` is scaled by the reference's largest magnitude so one table fits outputs and
    gradients, whose scales differ.
    """

    atol: float
    rtol: float


# Inputs are rounded to the dtype before the float64 reference sees them, so these bound only the
# backend's arithmetic: fp32 accumulation plus, for 16-bit inputs, probabilities rounded to the
# input dtype before the P @ V product (what every fused kernel does) and the rounded output.
DEFAULT_TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(atol=1e-9, rtol=1e-9),
    torch.float32: Tolerance(atol=2e-4, rtol=2e-4),
    torch.float16: Tolerance(atol=5e-3, rtol=5e-3),
    torch.bfloat16: Tolerance(atol=3e-2, rtol=3e-2),
}


@attrs.frozen(kw_only=True)
class BiasSpec:
    """The relative bias of a drawn case: bucket counts (``num_time_buckets = 0``: no time
    weights) and the time divisor. Weights (std 0.5) and timestamps are drawn from the case's
    seed; timestamps lie in ``[0, max_timestamp]`` so float32 and float64 time buckets agree."""

    num_position_buckets: int
    num_time_buckets: int = 0
    time_bucket_divisor: float = 0.301
    max_timestamp: int = 5000


def padded_biased_attention(
    q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, num_targets: Tensor | None,
    params: AttentionParams, position_weights: Tensor, time_weights: Tensor | None,
    timestamps: Tensor | None, time_bucket_divisor: float,
) -> Tensor:
    """The oracle of the relative bias, independent of every backend: self-attention over
    samples padded to the longest, in the dtype of the inputs (float64 in the suite), with the
    bucket formulas of :mod:`gem_core.attention.relative_bias` written out again here (the time
    bucket in the inputs' precision). Differentiable in every tensor argument."""
    batch, total = lengths.numel(), q.shape[0]
    heads, dim = q.shape[1:]
    width = int(lengths.max()) if batch else 0
    if total == 0 or width == 0:
        return q * 0.0
    targets = num_targets if num_targets is not None else torch.zeros_like(lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    slot = torch.arange(width)
    valid = slot[None, :] < lengths[:, None]  # (B, W)
    token = (starts[:, None] + slot[None, :]).clamp(max=total - 1)
    pad = lambda t: t[token] * valid[..., None, None].to(t.dtype)  # noqa: E731  (B, W, H, D)
    qp, kp, vp = pad(q), pad(k), pad(v)
    scale = params.resolved_scale(dim)
    scores = torch.einsum("bihd,bjhd->bhij", qp, kp) * scale
    history = (lengths - targets)[:, None]
    pos = torch.where(slot[None, :] < history, slot[None, :], history)  # targets sit at H
    distance = (pos[:, :, None] - pos[:, None, :]).abs()
    p_bucket = distance.clamp(max=position_weights.shape[1] - 1)
    bias = position_weights[:, p_bucket]  # (H, B, W, W)
    if time_weights is not None:
        ts = timestamps[token]
        dt = (ts[:, :, None] - ts[:, None, :]).abs().clamp(min=1).to(q.dtype)
        t_bucket = torch.floor(torch.log(dt) / time_bucket_divisor).long()
        bias = bias + time_weights[:, t_bucket.clamp(max=time_weights.shape[1] - 1)]
    scores = scores + bias.transpose(0, 1).to(q.dtype)
    mask = self_attention_masks(lengths, targets, params, width)[:, None]  # (B, 1, W, W)
    if params.normalization == "softmax":
        any_seen = mask.any(-1, keepdim=True)
        masked = scores.masked_fill(~mask, float("-inf")).masked_fill(~any_seen, 0.0)
        probs = torch.softmax(masked, dim=-1) * mask
    else:
        probs = F.silu(scores) * mask / lengths.clamp(min=1).to(q.dtype)[:, None, None, None]
    out = torch.einsum("bhij,bjhd->bihd", probs, vp)
    return out[valid]


@attrs.frozen(kw_only=True)
class AttentionCase:
    """One drawn batch: everything needed to rebuild the inputs and say what failed."""

    shape: str
    q_lengths: tuple[int, ...]
    kv_lengths: tuple[int, ...]
    params: AttentionParams
    num_targets: tuple[int, ...] | None
    heads: int
    head_dim: int
    dtype: torch.dtype
    seed: int
    bias: BiasSpec | None = None
    """A relative bias (self-attention only), or None."""


def _close(name: str, got: Tensor, want: Tensor, tol: Tolerance, case: AttentionCase,
           slack: Tensor | None = None) -> None:
    """Elementwise comparison under ``tol``; ``slack`` (broadcast to ``want``) widens the bound
    by an error the suite has measured rather than assumed."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    got64 = got.detach().to("cpu", torch.float64)
    want64 = want.detach().to("cpu", torch.float64)
    assert torch.isfinite(got64).all(), f"{name} has non-finite values for {case}"
    if want64.numel() == 0:
        return
    scale = max(1.0, float(want64.abs().max()))
    err = (got64 - want64).abs()
    bound = tol.atol * scale + tol.rtol * want64.abs()
    if slack is not None:
        bound = bound + slack
    if bool((err > bound).any()):
        worst = int(torch.argmax(err - bound))
        raise AssertionError(
            f"{name} differs from the float64 reference: max abs error {float(err.max()):.3e}, "
            f"worst element {worst} got {float(got64.flatten()[worst]):.6e} want "
            f"{float(want64.flatten()[worst]):.6e} (atol {tol.atol} x {scale:.3g}, rtol "
            f"{tol.rtol}); case {case}"
        )
