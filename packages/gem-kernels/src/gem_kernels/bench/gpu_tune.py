"""Tile and launch settings of the Triton attention kernels, timed on the benchmark's shapes.

    python -m gem_kernels.bench.gpu_tune [--device cuda] [--size full]

For each self-attention shape (causal, and window 512) it times the forward kernel under each
forward candidate and the backward kernels under each backward candidate (the two are chosen
independently), and checks every candidate's outputs against the current defaults' on the same
inputs (bf16; a candidate that disagrees is marked, one that does not fit in shared memory is
skipped). It prints one table; the defaults in ``triton_backend`` are chosen from it.
On a CPU (``--device cpu --size tiny``, kernels interpreted) it only checks that it runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable

import torch

from gem_kernels.attention import triton_op
from gem_kernels.bench.attention import BenchConfig, _shape_inputs

# (block_m, block_n, num_warps, num_stages); None stages: triton's default.
FORWARD = [(64, 64, 4, None), (64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 2)]
# ((dkdv query tile, dkdv key tile), (dq query tile, dq key tile), num_warps, num_stages)
BACKWARD = [((64, 64), (64, 64), 4, None), ((32, 64), (64, 32), 4, 3), ((32, 128), (128, 32), 4, 3),
            ((32, 128), (128, 32), 8, 2), ((64, 128), (128, 64), 8, 1)]
SIZES = {"full": dict(batch=32, max_len=4096, head_dim=128, window=512, repeats=10),
         "tiny": dict(batch=3, max_len=40, head_dim=16, window=8, repeats=1)}


def _time(step: Callable[[], Any], device: str, repeats: int) -> float:
    step()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _error(got: tuple, want: tuple) -> float:
    return max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))
               for a, b in zip(got, want))


def tune_shape(cfg: BenchConfig, window: int | None) -> dict[str, Any]:
    x = _shape_inputs(cfg, "self")
    nt = torch.zeros(len(x.q_lengths), dtype=torch.int64, device=cfg.device)
    w = -1 if window is None else window
    head = (x.q, x.k, x.v, x.q_offsets, x.kv_offsets, nt, True, True, w, 0, False,
            cfg.head_dim ** -0.5, max(x.q_lengths), max(x.kv_lengths))
    default_out, default_lse = triton_op._forward(*head, 64, 64)
    default_grads = triton_op._backward_kernels(x.grad, x.q, x.k, x.v, default_out, default_lse,
                                                *head[3:], 64, 64)
    rows: dict[str, Any] = {"forward": [], "backward": []}
    for bm, bn, warps, stages in FORWARD:
        row = {"blocks": [bm, bn], "num_warps": warps, "num_stages": stages}
        try:
            out = triton_op._forward(*head, bm, bn, num_warps=warps, num_stages=stages)
            row["rel_error"] = _error(out, (default_out, default_lse))
            row["ms"] = 1e3 * _time(
                lambda bm=bm, bn=bn, warps=warps, stages=stages: triton_op._forward(
                    *head, bm, bn, num_warps=warps, num_stages=stages),
                cfg.device, cfg.repeats)
        except Exception as error:  # a candidate over the shared-memory limit is skipped
            row["skipped"] = f"{type(error).__name__}: {str(error)[:160]}"
        rows["forward"].append(row)
    for dkdv, dq, warps, stages in BACKWARD:
        row = {"dkdv_blocks": list(dkdv), "dq_blocks": list(dq), "num_warps": warps,
               "num_stages": stages}

        def step(dkdv=dkdv, dq=dq, warps=warps, stages=stages):
            return triton_op._backward_kernels(
                x.grad, x.q, x.k, x.v, default_out, default_lse, *head[3:], 64, 64,
                dkdv_blocks=dkdv, dq_blocks=dq, num_warps=warps, num_stages=stages,
                allow_known_wrong=True)  # measuring the refused settings is the point
        try:
            grads = step()
            row["rel_error"] = _error(grads, default_grads)
            # Per gradient, so a wrong setting shows which kernel is at fault (dQ has its own
            # kernel; dK and dV share one).
            row["rel_error_dq_dk_dv"] = [_error((g,), (d,)) for g, d in zip(grads, default_grads)]
            row["ms"] = 1e3 * _time(step, cfg.device, cfg.repeats)
        except Exception as error:
            row["skipped"] = f"{type(error).__name__}: {str(error)[:160]}"
        rows["backward"].append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--size", default="full", choices=sorted(SIZES))
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    size = SIZES[args.size]
    report = {}
    for label, window in (("self_causal", None), (f"self_window{size['window']}", size["window"])):
        cfg = BenchConfig(device=args.device, dtype=torch.bfloat16, batch_size=size["batch"],
                          max_len=size["max_len"], heads=4, head_dim=size["head_dim"],
                          window=window, short_len=16, distribution="zipf", zipf_a=1.2,
                          repeats=size["repeats"], warmup=1, seed=0)
        report[label] = tune_shape(cfg, window)
        for part in ("forward", "backward"):
            for row in report[label][part]:
                settings = {k: v for k, v in row.items()
                            if k not in ("ms", "rel_error", "rel_error_dq_dk_dv")}
                result = (f"{row['ms']:8.3f} ms  rel err {row['rel_error']:.1e}"
                          if "ms" in row else "skipped")
                if "rel_error_dq_dk_dv" in row:
                    result += " (dq/dk/dv " + "/".join(
                        f"{e:.0e}" for e in row["rel_error_dq_dk_dv"]) + ")"
                print(f"{label:18} {part:8} {json.dumps(settings)[:110]:110} {result}",
                      flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
