"""Where the time of one attention backend's forward + backward goes, per shape: the host time of
a step without a device sync, the synced wall time, and torch.profiler's table of device kernels.

    python -m gem_kernels.bench.gpu_profile --backend triton --shapes pma cross self

Same inputs as ``gem bench attention`` (Zipf(1.2) lengths). On a CPU the kernels must be
interpreted (TRITON_INTERPRET=1) and the table lists CPU operators instead.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from gem_kernels.bench.attention import BenchConfig, _jagged_step, _shape_inputs

#: The backends this tool builds itself (with its tile options), by registered name.
PROFILED = ("triton", "blocked")


def _backend(name: str, block_m: int | None, block_n: int | None):
    if name == "triton":
        from gem_kernels.attention.triton_backend import TritonAttention
        return TritonAttention(block_m, block_n)
    if name == "blocked":
        from gem_kernels.attention.blocked_backend import BlockedAttention
        return BlockedAttention()
    raise SystemExit(f"gpu_profile: unknown backend {name!r} ({', '.join(PROFILED)})")


def profile_shape(cfg: BenchConfig, backend, shape: str, rows: int, sort: str) -> str:
    step = _jagged_step(backend, _shape_inputs(cfg, shape))
    cuda = cfg.device == "cuda"
    for _ in range(3):
        step()
    if cuda:
        torch.cuda.synchronize()
    host, wall = [], []
    for _ in range(cfg.repeats):
        start = time.perf_counter()
        step()
        host.append(time.perf_counter() - start)  # launch cost: no sync before this point
        if cuda:
            torch.cuda.synchronize()
        wall.append(time.perf_counter() - start)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(cfg.repeats):
            step()
        if cuda:
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if cuda and sort == "device" else "self_cpu_time_total"
    return (f"== {shape}: host {statistics.median(host) * 1e3:.3f} ms/step, wall "
            f"{statistics.median(wall) * 1e3:.3f} ms/step (median of {cfg.repeats}); totals "
            f"below are over {cfg.repeats} steps\n"
            + prof.key_averages().table(sort_by=key, row_limit=rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="triton", choices=PROFILED)
    parser.add_argument("--shapes", nargs="+", default=["pma", "cross", "self"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--window", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--block-m", type=int, default=None, help="triton query tile")
    parser.add_argument("--block-n", type=int, default=None, help="triton key tile")
    parser.add_argument("--num-warps", type=int, default=None,
                        help="experiment: warps per triton program (the backend's is fixed)")
    parser.add_argument("--sort", choices=["device", "host"], default="device",
                        help="order the table by device (kernel) time or host (CPU) time")
    parser.add_argument("--rows", type=int, default=12, help="profiler table rows")
    args = parser.parse_args(argv)
    cfg = BenchConfig(device=args.device, dtype=torch.bfloat16, batch_size=args.batch,
                      max_len=args.max_len, heads=4, head_dim=args.head_dim, window=args.window,
                      short_len=16, distribution="zipf", zipf_a=1.2, repeats=args.repeats,
                      warmup=1, seed=0)
    backend = _backend(args.backend, args.block_m, args.block_n)
    if args.num_warps is not None:
        from gem_kernels.attention import triton_op
        triton_op.NUM_WARPS = args.num_warps  # read at every launch; this process only
    for shape in args.shapes:
        print(profile_shape(cfg, backend, shape, args.rows, args.sort), flush=True)


if __name__ == "__main__":
    main()
