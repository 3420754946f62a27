"""Batch balancing: assigning the samples of a global batch to ranks so their costs are even."""

from __future__ import annotations

import heapq
from typing import Any, Sequence


def lpt_balancer(costs: Sequence[float], num_ranks: int) -> list[list[int]]:
    """Longest processing time first: the costliest remaining sample goes to the least loaded
    rank (ties to the rank with fewer samples, then to the lower rank, so the result is
    deterministic). Within 4/3 of the optimal makespan; with at least ``num_ranks`` samples
    every rank gets one, zero costs included (an empty rank ties with a rank holding only
    zero-cost samples on load, and wins on count)."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    heap = [(0.0, 0, rank) for rank in range(num_ranks)]
    shares: list[list[int]] = [[] for _ in range(num_ranks)]
    for index in order:
        load, count, rank = heapq.heappop(heap)
        shares[rank].append(index)
        heapq.heappush(heap, (load + float(costs[index]), count + 1, rank))
    return [sorted(share) for share in shares]


def karmarkar_karp_balancer(costs: Sequence[float], num_ranks: int) -> list[list[int]]:
    """Largest differencing (Karmarkar-Karp) for ``num_ranks`` ways.

    Every sample starts as a partial solution (its cost on one rank, nothing elsewhere); the two
    partial solutions with the largest spread (max - min rank load) are merged, pairing the
    heaviest rank of one with the lightest of the other, until one is left. Usually much closer
    to optimal than LPT on heavy-tailed costs because big items cancel each other early.
    Deterministic (ties broken by creation order); with at least ``num_ranks`` samples every
    rank gets one."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if not costs:
        return [[] for _ in range(num_ranks)]
    # A partial solution: (load, indices) per rank, heaviest first. Indices are kept as a tree
    # of pairs (merging is O(1), not a list copy) and flattened once at the end.
    heap: list[tuple[float, int, list[tuple[float, Any]]]] = []
    for index, cost in enumerate(costs):
        ways = [(float(cost), index)] + [(0.0, None) for _ in range(num_ranks - 1)]
        heap.append((-float(cost), index, ways))
    heapq.heapify(heap)
    counter = len(costs)
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        # first: heaviest first; second reversed: lightest first -> pair heavy with light.
        merged = [(a_load + b_load, (a_idx, b_idx))
                  for (a_load, a_idx), (b_load, b_idx) in zip(first, reversed(second))]
        merged.sort(key=lambda way: -way[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
        counter += 1
    shares = [sorted(_flatten(tree)) for _, tree in heap[0][2]]
    _fill_empty_ranks(shares, costs)
    return shares


def _flatten(tree: Any) -> list[int]:
    out: list[int] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if node is None:
            continue
        if isinstance(node, tuple):
            stack.extend(node)
        else:
            out.append(node)
    return out


def _fill_empty_ranks(shares: list[list[int]], costs: Sequence[float]) -> None:
    """No rank may idle while another holds several samples (zero costs can leave one empty):
    move the cheapest sample of the fullest rank to each empty one."""
    for empty in [r for r, share in enumerate(shares) if not share]:
        donor = max(range(len(shares)), key=lambda r: (len(shares[r]), -r))
        if len(shares[donor]) < 2:
            return
        moved = min(shares[donor], key=lambda i: (costs[i], i))
        shares[donor].remove(moved)
        shares[empty].append(moved)


def imbalance(costs: Sequence[float], shares: list[list[int]]) -> float:
    """Max over mean of the per-rank cost (1.0 is perfect balance)."""
    loads = [sum(costs[i] for i in share) for share in shares]
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0
