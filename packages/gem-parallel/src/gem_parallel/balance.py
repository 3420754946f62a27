"""Batch balancing: assigning the samples of a global batch to ranks so their costs are even."""

from __future__ import annotations

import heapq
from typing import Sequence


def lpt_balancer(costs: Sequence[float], num_ranks: int) -> list[list[int]]:
    """Longest processing time first: the costliest remaining sample goes to the least loaded
    rank (ties to the lower rank, so the result is deterministic). Within 4/3 of the optimal
    makespan; with at least ``num_ranks`` samples every rank gets one."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    heap = [(0.0, rank) for rank in range(num_ranks)]
    shares: list[list[int]] = [[] for _ in range(num_ranks)]
    for index in order:
        load, rank = heapq.heappop(heap)
        shares[rank].append(index)
        heapq.heappush(heap, (load + float(costs[index]), rank))
    return [sorted(share) for share in shares]


def imbalance(costs: Sequence[float], shares: list[list[int]]) -> float:
    """Max over mean of the per-rank cost (1.0 is perfect balance)."""
    loads = [sum(costs[i] for i in share) for share in shares]
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0
