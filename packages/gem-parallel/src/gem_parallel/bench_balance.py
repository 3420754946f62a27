"""``gem bench balance``: how evenly each balancer spreads attention cost over ranks.

Histories follow Zipf(1.2) lengths capped at 4096 (heavy-tailed like real ads logs); a sample is
a request with one history and ``--candidates`` candidates, and its cost is what the trainer
balances on (:func:`gem_core.flops.sample_costs`): its causal attention (query, key)
pairs plus its tokens plus its candidates. Reported:
per-rank max/mean cost (1.0 is perfect; the slowest rank sets the step time, so this is the
straggler factor of the attention work) for contiguous slices, LPT and Karmarkar-Karp, and each
balancer's time per global batch.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any, Callable

import click
import numpy as np
import torch

from gem_core.data.api import contiguous_balancer
from gem_core.flops import sample_costs
from gem_parallel.balance import imbalance, karmarkar_karp_balancer, lpt_balancer

BALANCERS: dict[str, Callable] = {"contiguous": contiguous_balancer, "lpt": lpt_balancer,
                                  "kk": karmarkar_karp_balancer}


def zipf_costs(rng: np.random.Generator, samples: int, *, exponent: float = 1.2,
               cap: int = 4096, candidates: int = 1) -> list[float]:
    """The trainer's cost of ``samples`` requests with Zipf history lengths and ``candidates``
    candidates each (no attention window)."""
    lengths = torch.from_numpy(np.minimum(rng.zipf(exponent, samples), cap)).to(torch.int64)
    return [float(c) for c in sample_costs(lengths, None, torch.full_like(lengths, candidates))]


def measure(*, ranks: int, per_rank: int, batches: int, timing_sizes: tuple[int, ...],
            seed: int, candidates: int = 1) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    ratios: dict[str, list[float]] = {name: [] for name in BALANCERS}
    bounds: list[float] = []
    for _ in range(batches):
        costs = zipf_costs(rng, ranks * per_rank, candidates=candidates)
        mean = sum(costs) / ranks
        # No assignment beats the costliest single sample or the mean load.
        bounds.append(max(max(costs), mean) / mean)
        for name, balancer in BALANCERS.items():
            ratios[name].append(imbalance(costs, balancer(costs, ranks)))
    timing: dict[str, dict[str, float]] = {name: {} for name in BALANCERS}
    for size in timing_sizes:
        costs = zipf_costs(rng, size, candidates=candidates)
        for name, balancer in BALANCERS.items():
            runs = []
            for _ in range(5):
                started = time.perf_counter()
                balancer(costs, ranks)
                runs.append(time.perf_counter() - started)
            timing[name][str(size)] = statistics.median(runs) * 1e3
    return {
        "benchmark": "batch balancing across data-parallel ranks",
        "lengths": "Zipf(1.2) capped at 4096",
        "cost": "causal attention (query, key) pairs + tokens + candidates per request (the "
                "trainer's cost_fn, gem_core.flops.sample_costs)",
        "candidates_per_request": candidates,
        "ranks": ranks, "samples_per_rank": per_rank, "global_batches": batches,
        "max_over_mean": {name: {"median": statistics.median(values), "worst": max(values)}
                          for name, values in ratios.items()},
        "max_over_mean_lower_bound": {"median": statistics.median(bounds),
                                      "worst": max(bounds)},
        "balancer_ms_per_global_batch": timing,
        "step_time_straggler_ratio": None,
        "step_time_straggler_ratio_note": "not measured here; max/mean cost is the model of it",
    }


@click.command(name="balance")
@click.option("--ranks", default=8, show_default=True)
@click.option("--per-rank", default=32, show_default=True, help="samples per rank")
@click.option("--batches", default=100, show_default=True, help="global batches drawn")
@click.option("--candidates", default=1, show_default=True, type=click.IntRange(min=1),
              help="candidates per request")
@click.option("--seed", default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def balance(ranks: int, per_rank: int, batches: int, candidates: int, seed: int,
            as_json: bool) -> None:
    """Per-rank max/mean cost of contiguous vs LPT vs Karmarkar-Karp, and balancer time."""
    report = measure(ranks=ranks, per_rank=per_rank, batches=batches,
                     timing_sizes=(256, 2048, 16384), seed=seed, candidates=candidates)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    for name, entry in report["max_over_mean"].items():
        times = report["balancer_ms_per_global_batch"][name]
        click.echo(f"{name:>10}: max/mean median {entry['median']:.4f} worst "
                   f"{entry['worst']:.4f}; ms per batch " +
                   ", ".join(f"{size}: {ms:.2f}" for size, ms in times.items()))
