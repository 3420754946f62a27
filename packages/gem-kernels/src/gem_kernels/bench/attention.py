"""The attention benchmark: jagged backends next to padded ``scaled_dot_product_attention``.

For each shape (self-attention, cross-attention, PMA) at heavy-tailed lengths it counts the
forward+backward FLOPs of the visible pairs (jagged) and of padding to the batch maximum, and
times forward+backward of every backend given, plus padded SDPA with a boolean mask (the code a
user writes today) and, for plain causal self-attention, padded SDPA with ``is_causal=True``
(the only padded form the flash kernel accepts). Times are medians over ``repeats``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

from gem_core.attention.api import AttentionParams
from gem_core.jagged import Jagged, offsets_from_lengths
from gem_kernels.bench.flops import (
    causal_window_pairs,
    jagged_pairs,
    min_bytes_fwd_bwd,
    padded_pairs,
    pair_flops,
)
from gem_kernels.bench.lengths import sample_lengths

SDPA_MASKED = "sdpa_padded_masked"
SDPA_CAUSAL = "sdpa_padded_is_causal"


@attrs.frozen(kw_only=True)
class BenchConfig:
    device: str
    dtype: torch.dtype
    batch_size: int
    max_len: int
    heads: int
    head_dim: int
    window: int | None
    short_len: int
    """K/V tokens per sample for cross-attention, queries per sample for PMA."""
    distribution: str
    zipf_a: float
    repeats: int
    warmup: int
    seed: int
    shapes: tuple[str, ...] = ("self", "cross", "pma")


@attrs.frozen(kw_only=True)
class ShapeInputs:
    q: Tensor
    k: Tensor
    v: Tensor
    grad: Tensor
    q_offsets: Tensor
    kv_offsets: Tensor
    q_lengths: list[int]
    kv_lengths: list[int]
    params: AttentionParams
    is_self: bool


def _shape_inputs(cfg: BenchConfig, shape: str) -> ShapeInputs:
    history = sample_lengths(cfg.batch_size, cfg.max_len, distribution=cfg.distribution,
                             zipf_a=cfg.zipf_a, seed=cfg.seed)
    short = [cfg.short_len] * cfg.batch_size
    q_lengths, kv_lengths = {
        "self": (history, history), "cross": (history, short), "pma": (short, history),
    }[shape]
    params = (AttentionParams(causal=True, window=cfg.window) if shape == "self"
              else AttentionParams())
    gen = torch.Generator().manual_seed(cfg.seed + 1)

    def make(total: int) -> Tensor:
        x = torch.randn(total, cfg.heads, cfg.head_dim, generator=gen)
        return x.to(device=cfg.device, dtype=cfg.dtype)

    q_offsets = offsets_from_lengths(torch.tensor(q_lengths)).to(cfg.device)
    kv_offsets = offsets_from_lengths(torch.tensor(kv_lengths)).to(cfg.device)
    return ShapeInputs(
        q=make(sum(q_lengths)), k=make(sum(kv_lengths)), v=make(sum(kv_lengths)),
        grad=make(sum(q_lengths)), q_offsets=q_offsets, kv_offsets=kv_offsets,
        q_lengths=q_lengths, kv_lengths=kv_lengths, params=params, is_self=shape == "self",
    )


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _median_seconds(step: Callable[[], None], cfg: BenchConfig) -> float:
    for _ in range(cfg.warmup):
        step()
    times = []
    for _ in range(cfg.repeats):
        _sync(cfg.device)
        start = time.perf_counter()
        step()
        _sync(cfg.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _jagged_step(backend: Any, x: ShapeInputs) -> Callable[[], None]:
    leaves = [t.detach().requires_grad_(True) for t in (x.q, x.k, x.v)]
    max_q, max_kv = max(x.q_lengths), max(x.kv_lengths)

    def step() -> None:
        out = backend(*leaves, x.q_offsets, x.kv_offsets, params=x.params,
                      max_q_len=max_q, max_kv_len=max_kv)
        torch.autograd.grad(out, leaves, x.grad)

    return step


def _padded(values: Tensor, offsets: Tensor, width: int) -> Tensor:
    """``(B, heads, width, d)``: the layout padded SDPA wants (made before timing starts)."""
    return Jagged(values, offsets).to_padded(width).transpose(1, 2).contiguous()


def _sdpa_steps(x: ShapeInputs) -> dict[str, Callable[[], None]]:
    max_q, max_kv = max(x.q_lengths), max(x.kv_lengths)
    q, grad = _padded(x.q, x.q_offsets, max_q), _padded(x.grad, x.q_offsets, max_q)
    k, v = _padded(x.k, x.kv_offsets, max_kv), _padded(x.v, x.kv_offsets, max_kv)
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    # The same mask on the padded grid; padded query rows see every key so no row is empty (an
    # all-masked row would give NaN). They are wasted work, which is what is being measured.
    device = x.q.device
    i = torch.arange(max_q, device=device)[None, :, None]
    j = torch.arange(max_kv, device=device)[None, None, :]
    kv_len = torch.tensor(x.kv_lengths, device=device)[:, None, None]
    q_len = torch.tensor(x.q_lengths, device=device)[:, None, None]
    mask = j < kv_len
    if x.is_self:  # the bench's self-attention is causal with an optional window
        mask = mask & (j <= i)
        if x.params.window is not None:
            mask = mask & (i - j <= x.params.window)
    pad_row = i >= q_len
    mask = (mask | pad_row)[:, None]

    def masked() -> None:
        out = F.scaled_dot_product_attention(*leaves, attn_mask=mask)
        torch.autograd.grad(out, leaves, grad)

    steps = {SDPA_MASKED: masked}
    if x.is_self and x.params.window is None and x.params.num_prefix == 0:
        # Right padding keeps causal rows inside their sample, so is_causal alone is exact for the
        # real rows and lets SDPA pick its flash kernel.
        def causal() -> None:
            out = F.scaled_dot_product_attention(*leaves, is_causal=True)
            torch.autograd.grad(out, leaves, grad)

        steps[SDPA_CAUSAL] = causal
    return steps


def run_attention_bench(cfg: BenchConfig, backends: dict[str, Any]) -> dict[str, Any]:
    """Time every backend on every shape; return the JSON-ready result."""
    result: dict[str, Any] = {}
    for shape in cfg.shapes:
        x = _shape_inputs(cfg, shape)
        jagged = pair_flops(jagged_pairs(x.q_lengths, x.kv_lengths, x.params, x.is_self),
                            cfg.heads, cfg.head_dim)
        padded = pair_flops(padded_pairs(x.q_lengths, x.kv_lengths), cfg.heads, cfg.head_dim)
        min_bytes = min_bytes_fwd_bwd(sum(x.q_lengths), sum(x.kv_lengths), cfg.heads,
                                      cfg.head_dim, x.q.element_size())
        times = {name: _median_seconds(step, cfg) for name, step in _sdpa_steps(x).items()}
        for name, backend in backends.items():
            times[name] = _median_seconds(_jagged_step(backend, x), cfg)
        if SDPA_CAUSAL in times:
            # is_causal SDPA skips the blocks above the diagonal: half the padded square.
            causal_pairs = len(x.q_lengths) * causal_window_pairs(max(x.q_lengths), None)
            padded_causal = pair_flops(causal_pairs, cfg.heads, cfg.head_dim)
        else:
            padded_causal = None
        baseline = min(t for name, t in times.items() if name.startswith("sdpa_"))
        speedups = {name: baseline / t for name, t in times.items() if name in backends}
        best = max(speedups, key=speedups.get) if speedups else None
        flop_ratio = padded / jagged if jagged else float("nan")
        # The goal compares with the padded masked SDPA a user writes today, whose
        # counted work is the padded FLOPs; the stricter figure above uses the fastest SDPA.
        over_masked = {name: times[SDPA_MASKED] / times[name] for name in backends}
        result[shape] = {
            "attention": {"causal": x.params.causal, "window": x.params.window,
                          "normalization": x.params.normalization},
            "q_tokens": sum(x.q_lengths),
            "kv_tokens": sum(x.kv_lengths),
            "max_q_len": max(x.q_lengths),
            "max_kv_len": max(x.kv_lengths),
            "fwd_bwd_flops_jagged": jagged,
            "fwd_bwd_flops_padded": padded,
            "padded_over_jagged_flops": flop_ratio,
            "padded_is_causal_over_jagged_flops": (padded_causal / jagged if padded_causal
                                                   else None),
            "fwd_bwd_median_s": times,
            "min_bytes_fwd_bwd": min_bytes,
            "jagged_tflops_per_s": {name: jagged / times[name] / 1e12 for name in backends},
            "min_bytes_gb_per_s": {name: min_bytes / times[name] / 1e9 for name in backends},
            "speedup_over_fastest_padded_sdpa": speedups,
            "best_backend": best,
            "best_speedup_over_flop_ratio": (speedups[best] / flop_ratio) if best else None,
            "speedup_over_masked_padded_sdpa": over_masked,
            "best_speedup_over_masked_over_flop_ratio": (
                max(over_masked.values()) / flop_ratio if over_masked else None),
        }
    return result
