"""``gem bench moe``: the mixture-of-experts layer's two execution paths and expert-parallel
traffic.

1. Tokens per second (forward + backward, one thread) of the ``grouped`` path (tokens sorted by
   expert, batched expert matmuls) against the ``reference`` path (experts one after another)
   on the same layer and the same tokens, median of repeats, at several token counts.
2. All-to-all bytes per step of ``ep`` on 2 ranks (gloo, spawned here): measured as the bytes
   the dispatcher hands to ``all_to_all_single`` (dispatch and combine, forward and backward),
   against the analytic prediction for uniform routing and the prediction from the routed
   counts of that step.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from typing import Any

import click
import torch

from gem_core.model.moe import MixtureOfExperts
from gem_parallel.plan import moe_all_to_all_bytes

LAYER = dict(kind="swiglu", dim=64, hidden=128, experts=8, top_k=2, capacity_factor=1.25)


def _layer(impl: str, *, seed: int = 0, **overrides: Any) -> MixtureOfExperts:
    spec = {**LAYER, **overrides}
    torch.manual_seed(seed)
    return MixtureOfExperts(spec["kind"], spec["dim"], spec["hidden"], spec["dim"],
                            num_experts=spec["experts"], top_k=spec["top_k"],
                            capacity_factor=spec["capacity_factor"], shared_expert=False,
                            aux_loss_weight=0.01, impl=impl)


def _step(layer: MixtureOfExperts, x: torch.Tensor) -> torch.Tensor:
    layer.zero_grad(set_to_none=True)
    out = layer(x)
    (out.square().mean() + layer.last_aux_loss).backward()
    return out.detach()


def time_paths(tokens: int, repeats: int, seed: int = 0) -> dict[str, Any]:
    """Median seconds per forward + backward of each path on the same layer and tokens."""
    # The input needs its gradient too, as inside a model.
    x = torch.randn(tokens, LAYER["dim"], generator=torch.Generator().manual_seed(seed),
                    requires_grad=True)
    layers = {impl: _layer(impl) for impl in ("reference", "grouped")}
    outputs = {impl: _step(layer, x) for impl, layer in layers.items()}  # warm-up
    cpu: dict[str, list[float]] = {impl: [] for impl in layers}
    wall: dict[str, list[float]] = {impl: [] for impl in layers}
    for _ in range(repeats):  # interleaved, so background load hits both alike
        for impl, layer in layers.items():
            started, started_cpu = time.perf_counter(), time.thread_time()
            _step(layer, x)
            cpu[impl].append(time.thread_time() - started_cpu)
            wall[impl].append(time.perf_counter() - started)
    median = {impl: statistics.median(values) for impl, values in cpu.items()}
    median_wall = {impl: statistics.median(values) for impl, values in wall.items()}
    return {
        "tokens": tokens,
        "reference_tokens_per_s": tokens / median["reference"],
        "grouped_tokens_per_s": tokens / median["grouped"],
        "grouped_speedup": median["reference"] / median["grouped"],
        "grouped_speedup_wall_clock": median_wall["reference"] / median_wall["grouped"],
        "grouped_backend": layers["grouped"].experts.last_grouped_backend,
        "max_abs_output_difference": float((outputs["grouped"] - outputs["reference"])
                                           .abs().max()),
    }


# -- all-to-all bytes on 2 ranks -------------------------------------------------------------------


def predicted_bytes_uniform(tokens: int, *, top_k: int, dim: int, ep_size: int,
                            bytes_per_element: int = 4) -> float:
    """``gem plan``'s prediction (:func:`gem_parallel.plan.moe_all_to_all_bytes`) for this
    layer: uniform routing, nothing dropped."""
    return moe_all_to_all_bytes(tokens, top_k=top_k, in_dim=dim, out_dim=dim, ep_size=ep_size,
                                bytes_per_element=bytes_per_element)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _traffic_worker(rank: int, world: int, port: int, tokens: int, out_path: str) -> None:
    import torch.distributed as dist

    from gem_parallel.expert_parallel import shard_experts

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    # Generous capacity: nothing dropped, so the prediction covers every routed row.
    layer = _layer("grouped", capacity_factor=0.0)
    traffic = shard_experts(layer, group=dist.group.WORLD, ep_rank=rank, ep_size=world)
    x = torch.randn(tokens, LAYER["dim"], generator=torch.Generator().manual_seed(rank + 1),
                    requires_grad=True)  # as inside a model: the dispatch has a backward too
    _step(layer, x)
    # The prediction from this step's routing: rows this rank routed to experts it does not own.
    routed = layer.last_stats["tokens"]
    local = LAYER["experts"] // world
    remote_rows = int(routed.sum()) - int(routed[rank * local:(rank + 1) * local].sum())
    row_bytes = LAYER["dim"] * 4
    report = {"rank": rank, "measured_bytes_remote": traffic.bytes_remote,
              "measured_bytes_total": traffic.bytes_total, "all_to_all_calls": traffic.calls,
              # dispatch + combine, forward + backward: the combine sends back what arrived,
              # which other ranks routed here; both directions together.
              "remote_rows_sent": remote_rows, "row_bytes": row_bytes}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, report)
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump(gathered, handle)
    dist.barrier()
    dist.destroy_process_group()


def measure_traffic(tokens: int, world: int = 2) -> dict[str, Any]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "traffic.json")
        mp.spawn(_traffic_worker, args=(world, _free_port(), tokens, path), nprocs=world,
                 join=True)
        with open(path) as handle:
            ranks = json.load(handle)
    # What rank r dispatches to others (forward) is rows it routed off-rank; the combine sends
    # back rows others routed to r's experts. Forward and backward each do both.
    dispatch = [r["remote_rows_sent"] for r in ranks]
    arrived = [sum(dispatch) - d for d in dispatch] if world == 2 else None
    per_rank = []
    for i, r in enumerate(ranks):
        from_counts = (None if arrived is None else
                       2 * (dispatch[i] + arrived[i]) * r["row_bytes"])
        per_rank.append({"rank": i, "measured_bytes": r["measured_bytes_remote"],
                         "measured_bytes_including_self": r["measured_bytes_total"],
                         "predicted_bytes_from_routed_counts": from_counts,
                         "all_to_all_calls": r["all_to_all_calls"]})
    return {
        "ranks": world, "tokens_per_rank": tokens,
        "predicted_bytes_per_rank_uniform_routing": predicted_bytes_uniform(
            tokens, top_k=LAYER["top_k"], dim=LAYER["dim"], ep_size=world),
        "per_rank": per_rank,
        "counted": "rows handed to all_to_all_single that leave the rank (dispatch and combine, "
                   "forward and backward, one MoE layer, one step); the row-count exchange "
                   f"({LAYER['experts']} int64 per rank per layer) is not included",
    }


def measure(*, tokens: tuple[int, ...], repeats: int, traffic_tokens: int) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        paths = [time_paths(count, repeats) for count in tokens]
    finally:
        torch.set_num_threads(threads)
    return {
        "benchmark": "mixture-of-experts layer: grouped vs reference path, ep all-to-all bytes",
        "layer": {**LAYER, "shared_expert": False},
        "device": "cpu", "threads": 1, "repeats": repeats,
        "timed": "forward + backward of the layer plus its load-balancing loss, median; tokens/s "
                 "from this thread's CPU time (a shared machine's other jobs do not count), "
                 "the wall-clock ratio next to it",
        "paths": paths,
        "grouped_speedup_best": max(p["grouped_speedup"] for p in paths),
        "grouped_speedup_at_largest": paths[-1]["grouped_speedup"],
        "all_to_all": measure_traffic(traffic_tokens),
    }


@click.command(name="moe")
@click.option("--tokens", default="256,1024,4096", show_default=True,
              help="comma-separated token counts to time")
@click.option("--repeats", default=7, show_default=True, help="timed repeats per path (median)")
@click.option("--traffic-tokens", default=1024, show_default=True,
              help="tokens per rank in the 2-rank all-to-all measurement")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def moe(tokens: str, repeats: int, traffic_tokens: int, as_json: bool) -> None:
    """Grouped vs reference MoE path (tokens/s, 8 experts) and ep all-to-all bytes."""
    counts = tuple(int(t) for t in tokens.split(",") if t.strip())
    report = measure(tokens=counts, repeats=repeats, traffic_tokens=traffic_tokens)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    for entry in report["paths"]:
        click.echo(f"{entry['tokens']:>6} tokens: reference {entry['reference_tokens_per_s']:.0f} "
                   f"tok/s, grouped {entry['grouped_tokens_per_s']:.0f} tok/s "
                   f"({entry['grouped_speedup']:.2f}x, {entry['grouped_backend']})")
    traffic = report["all_to_all"]
    click.echo(f"all-to-all bytes per rank per step (2 ranks, {traffic['tokens_per_rank']} "
               f"tokens): predicted {traffic['predicted_bytes_per_rank_uniform_routing']:.0f} "
               "(uniform) | " + ", ".join(
                   f"rank {r['rank']}: measured {r['measured_bytes']}, from counts "
                   f"{r['predicted_bytes_from_routed_counts']}" for r in traffic["per_rank"]))
