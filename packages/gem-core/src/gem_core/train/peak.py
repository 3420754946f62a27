"""The peak FLOP/s that MFU is measured against: measured on this device, not assumed."""

from __future__ import annotations

import time

import torch


def measure_matmul_peak(device: torch.device, *, repeats: int = 5) -> float:
    """Best observed dense-matmul FLOP/s in the dtype training mostly uses on ``device``.

    On CPU: float32 1024^3 products; on CUDA: bfloat16 8192^3. The best of ``repeats`` runs is
    taken because the peak is what the hardware can do, not what a noisy moment allowed.
    """
    if device.type == "cuda":
        n, dtype = 8192, torch.bfloat16
    else:
        n, dtype = 1024, torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.matmul(a, b)  # warm up
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.matmul(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best
