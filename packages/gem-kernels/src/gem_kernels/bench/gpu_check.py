"""The GPU check ``tools/gpu_check.sh`` runs: correctness in bf16, peaks, benchmark, a short table.

1. correctness: the ``triton`` and ``reference`` backends in bf16 against the float64 reference
   on fixed cases of every shape, mask and normalisation (the conformance suite's ``check_case``,
   without pytest or hypothesis, which the GPU image may lack);
2. the measured bf16 matmul rate and copy bandwidth of this device (the ceilings MFU and
   bandwidth figures are read against);
3. ``run_attention_bench`` on each shape (self-attention full causal and with a local window,
   cross-attention, PMA) at Zipf(1.2) lengths;
4. one JSON file, then a short table printed last.

Only torch and triton are needed (no fbgemm, no torchrec). ``--size tiny --device cpu`` runs the
same code under ``TRITON_INTERPRET=1`` in seconds, which is how CI keeps it working.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from typing import Any, Callable

import torch

from gem_core.attention.api import AttentionParams
from gem_core.attention.reference import ReferenceAttention
from gem_core.norm import gated_norm_reference
from gem_core.testing.attention_conformance import AttentionCase, AttentionConformance
from gem_kernels.attention.blocked_backend import BlockedAttention
from gem_kernels.attention.triton_backend import TritonAttention
from gem_kernels.bench.attention import BenchConfig, run_attention_bench
from gem_kernels.bench.gpu_model_check import check_model, check_moe, model_lines
from gem_kernels.norms.triton_op import gated_norm

SIZES = {
    # long: the long history length of the correctness cases; bench: the benchmark's settings.
    "full": {"long": 1000, "block": 64, "batch": 32, "max_len": 4096, "heads": 4, "head_dim": 128,
             "window": 512, "short": 16, "repeats": 10, "peak_n": 8192, "copy_mib": 1024},
    "tiny": {"long": 40, "block": 16, "batch": 3, "max_len": 24, "heads": 1, "head_dim": 16,
             "window": 4, "short": 2, "repeats": 1, "peak_n": 256, "copy_mib": 8},
}


def _cases(size: dict, dtype: torch.dtype) -> list[AttentionCase]:
    long, block = size["long"], size["block"]
    cases = []
    for normalization in ("softmax", "silu"):
        lengths = (long, 0, 1, block + 1, block)
        for params, targets in (
            (AttentionParams(causal=True, normalization=normalization), None),
            (AttentionParams(causal=True, window=block + 3, num_prefix=3,
                             normalization=normalization), (3, 0, 1, 2, 0)),
            (AttentionParams(window=block // 2, normalization=normalization), None),
        ):
            cases.append(AttentionCase(shape="self", q_lengths=lengths, kv_lengths=lengths,
                                       params=params, num_targets=targets, heads=2,
                                       head_dim=size["head_dim"], dtype=dtype, seed=len(cases)))
        plain = AttentionParams(normalization=normalization)
        cases.append(AttentionCase(shape="cross", q_lengths=(long, 3, 0, block + 1),
                                   kv_lengths=(8, 1, 0, 0), params=plain, num_targets=None,
                                   heads=2, head_dim=size["head_dim"], dtype=dtype,
                                   seed=len(cases)))
        cases.append(AttentionCase(shape="pma", q_lengths=(4, 4, 0, 1),
                                   kv_lengths=(long, 0, 5, block + 1), params=plain,
                                   num_targets=None, heads=2, head_dim=size["head_dim"],
                                   dtype=dtype, seed=len(cases)))
    return cases


def check_correctness(device: str, size: dict, dtype: torch.dtype) -> list[dict[str, Any]]:
    backends = {"triton": TritonAttention(size["block"], size["block"]),
                "reference": ReferenceAttention()}
    rows = []
    for name, backend in backends.items():
        suite = AttentionConformance()
        suite.device = device
        suite.make_backend = lambda backend=backend: backend
        for case in _cases(size, dtype):
            label = (f"{case.shape} {case.params.normalization} causal={case.params.causal} "
                     f"window={case.params.window} prefix={case.params.num_prefix}")
            try:
                suite.check_case(case)
                rows.append({"backend": name, "case": label, "ok": True})
            except Exception as error:  # record every failure (a kernel that does not
                # compile included), then fail the whole check
                rows.append({"backend": name, "case": label, "ok": False,
                             "error": f"{type(error).__name__}: {error}"[:400]})
    return rows


def check_gated_norm(device: str, dtype: torch.dtype) -> list[dict[str, Any]]:
    """The fused gated norm in ``dtype`` against its reference in float64, with gradients."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    for kind in ("layer", "rms"):
        x, gate = (torch.randn(300, 96, generator=gen) for _ in range(2))
        weight, bias = torch.randn(96, generator=gen) + 1, torch.randn(96, generator=gen)
        grad = torch.randn(300, 96, generator=gen)
        errors = []
        for compute in (dtype, torch.float64):
            leaves = [t.to(device=device, dtype=dtype).to(compute).requires_grad_(True)
                      for t in (x, gate, weight, bias)]
            fn = gated_norm if compute == dtype else gated_norm_reference
            out = fn(*leaves, kind=kind)
            grads = torch.autograd.grad(out, leaves, grad.to(device=device, dtype=compute))
            errors.append([t.detach().double().cpu() for t in (out, *grads)])
        worst = max(float((a - b).abs().max() / max(1.0, float(b.abs().max())))
                    for a, b in zip(*errors))
        ok = worst < 3e-2
        rows.append({"backend": "gated_norm", "case": f"{kind} norm 300x96, grads",
                     "ok": ok, **({} if ok else {"error": f"relative error {worst:.3e}"})})
    return rows


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure_peaks(device: str, size: dict) -> dict[str, float]:
    """bf16 matmul TFLOP/s and device copy GB/s, best of a few runs."""
    n = size["peak_n"]
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    src = torch.empty(size["copy_mib"] * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best_mm = best_copy = float("inf")
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        for _ in range(5):
            a @ b
        _sync(device)
        best_mm = min(best_mm, (time.perf_counter() - start) / 5)
        start = time.perf_counter()
        for _ in range(5):
            dst.copy_(src)
        _sync(device)
        best_copy = min(best_copy, (time.perf_counter() - start) / 5)
    return {"bf16_matmul_tflops": 2 * n**3 / best_mm / 1e12,
            "copy_gb_per_s": 2 * src.numel() / best_copy / 1e9}


def run_bench(device: str, size: dict, dtype: torch.dtype, results: dict[str, Any],
              saved: Callable[[], None]) -> dict[str, Any]:
    """Fills ``results`` shape by shape, calling ``saved`` after each (a run cut by the time
    limit keeps the shapes it finished)."""
    backends = {"triton": TritonAttention(size["block"], size["block"]),
                "reference": ReferenceAttention(), "blocked": BlockedAttention()}
    for label, shapes, window in (("self_causal", ("self",), None),
                                  (f"self_window{size['window']}", ("self",), size["window"]),
                                  ("cross_pma", ("cross", "pma"), None)):
        cfg = BenchConfig(
            device=device, dtype=dtype, batch_size=size["batch"], max_len=size["max_len"],
            heads=size["heads"], head_dim=size["head_dim"], window=window,
            short_len=size["short"], distribution="zipf", zipf_a=1.2, repeats=size["repeats"],
            warmup=1, seed=0, shapes=shapes,
        )
        for shape, result in run_attention_bench(cfg, backends).items():
            results[label if shape == "self" else shape] = result
        # Progress on stderr, so a run cut by the time limit still says how far it got.
        times = {k: r["fwd_bwd_median_s"] for k, r in results.items()}
        print(f"bench {label} done: {json.dumps(times)}", file=sys.stderr)
        saved()
    return results


def table(report: dict[str, Any]) -> str:
    peaks = report["peaks"]
    mm = peaks.get("bf16_matmul_tflops", float("nan"))
    bw = peaks.get("copy_gb_per_s", float("nan"))
    lines = [
        f"device {report['device']}  torch {report['torch']}  triton {report['triton']}  "
        f"bf16 matmul {mm:.0f} TFLOP/s  copy {bw:.0f} GB/s",
        f"correctness (bf16 vs float64): {report['correct_cases']}/{report['total_cases']} "
        "cases ok",
        *model_lines(report),
        f"{'shape':18} {'backend':22} {'ms':>9} {'vs SDPA':>8} {'pad/jag':>8} {'TFLOP/s':>8} "
        f"{'%mm':>5} {'GB/s':>7} {'%bw':>5}",
    ]
    def cell(value: float | None, fmt: str) -> str:
        return "" if value is None else format(value, fmt)

    for shape, r in report["bench"].items():
        for name, seconds in r["fwd_bwd_median_s"].items():
            speedup = r["speedup_over_fastest_padded_sdpa"].get(name)
            tflops = r["jagged_tflops_per_s"].get(name)
            gbs = r["min_bytes_gb_per_s"].get(name)
            lines.append(
                f"{shape:18} {name:22} {seconds * 1e3:9.2f} "
                f"{cell(speedup, '.2f'):>8} {r['padded_over_jagged_flops']:7.2f}x "
                f"{cell(tflops, '.1f'):>8} {cell(tflops and 100 * tflops / mm, '.0f'):>5} "
                f"{cell(gbs, '.0f'):>7} {cell(gbs and 100 * gbs / bw, '.0f'):>5}"
            )
    return "\n".join(lines)


def _run_section(report: dict[str, Any], key: str, fn: Callable[[], Any], out: str) -> None:
    """Run one section into ``report[key]`` and rewrite the JSON file, so a run cut by the time
    limit keeps what it measured. A section that raises is recorded under ``errors`` (and fails
    the check); the others still run."""
    started = time.perf_counter()
    try:
        report[key] = fn()
    except Exception as error:  # one broken section must not hide the others' results
        report["errors"][key] = f"{type(error).__name__}: {error}"[:2000]
        traceback.print_exc(file=sys.stderr)
    print(f"{key} done in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    _save(report, out)


def _save(report: dict[str, Any], out: str) -> None:
    with open(out, "w") as f:
        json.dump(report, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--size", default="full", choices=sorted(SIZES))
    parser.add_argument("--out", default="gpu_check.json", help="where to write the JSON report")
    args = parser.parse_args(argv)
    import triton

    size = SIZES[args.size]
    dtype = torch.bfloat16
    started = time.perf_counter()
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__, "triton": triton.__version__, "dtype": "bfloat16",
        "errors": {}, "correctness": [], "peaks": {}, "moe": [], "model": [], "bench": {},
    }
    # Cheapest and most telling first: a run cut by the limit still has correctness and peaks.
    _run_section(report, "correctness", lambda: check_correctness(args.device, size, dtype)
                 + check_gated_norm(args.device, dtype), args.out)
    report["correct_cases"] = sum(row["ok"] for row in report["correctness"])
    report["total_cases"] = len(report["correctness"])
    _run_section(report, "peaks", lambda: measure_peaks(args.device, size), args.out)
    _run_section(report, "moe", lambda: check_moe(args.device, args.size), args.out)
    _run_section(report, "model", lambda: check_model(args.device, args.size), args.out)
    _run_section(report, "bench", lambda: run_bench(
        args.device, size, dtype, report["bench"], lambda: _save(report, args.out)), args.out)
    report["seconds"] = time.perf_counter() - started
    _save(report, args.out)
    for row in report["correctness"]:
        if not row["ok"]:
            print(f"FAIL {row['backend']} {row['case']}: {row['error']}", file=sys.stderr)
    for key, error in report["errors"].items():
        print(f"FAIL section {key}: {error.splitlines()[0]}", file=sys.stderr)
    print(table(report))
    ok = (report["correct_cases"] == report["total_cases"] > 0 and not report["errors"]
          and all(r.get("loss_relative_error", 0) < 2e-2 for r in report["model"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
