"""What a data source gives the trainer: a schema, a resumable training stream, an eval split."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from gem_core import contracts
from gem_core.batch import JaggedBatch

Balancer = contracts.Balancer
TrainStream = contracts.TrainStream
DataSource = contracts.DataSource
"""The contracts of kind ``data`` (:mod:`gem_core.contracts`)."""


def contiguous_balancer(costs: Sequence[float], num_ranks: int) -> list[list[int]]:
    """The reference balancer: equal-count contiguous slices, ignoring cost (what a naive loader
    does). The first ``len(costs) % num_ranks`` ranks get one sample more."""
    n = len(costs)
    base, extra = divmod(n, num_ranks)
    shares, start = [], 0
    for rank in range(num_ranks):
        size = base + (1 if rank < extra else 0)
        shares.append(list(range(start, start + size)))
        start += size
    return shares


def local_share(
    batch: JaggedBatch, *, rank: int, world_size: int, balancer: Balancer,
    cost_fn: Callable[[JaggedBatch], Sequence[float]],
) -> JaggedBatch:
    """This rank's samples of a global batch, checking the balancer lost or repeated none."""
    if world_size == 1:
        return batch
    shares = balancer(cost_fn(batch), world_size)
    assigned = sorted(i for share in shares for i in share)
    if len(shares) != world_size or assigned != list(range(batch.batch_size)):
        raise RuntimeError(
            f"batch balancer returned an invalid assignment: {len(shares)} shares for "
            f"{world_size} ranks covering {len(assigned)} of {batch.batch_size} samples"
        )
    return batch.select(torch.tensor(shares[rank], dtype=torch.int64))


class IndexedStream(TrainStream):
    """A training stream over batches that are a pure function of their index (generated data):
    the position is the next index, so resuming is exact and costs nothing."""

    def __init__(self, make_global_batch: Callable[[int], JaggedBatch], *, rank: int,
                 world_size: int, balancer: Balancer,
                 cost_fn: Callable[[JaggedBatch], Sequence[float]]) -> None:
        self.make_global_batch = make_global_batch
        self.rank, self.world_size = rank, world_size
        self.balancer, self.cost_fn = balancer, cost_fn
        self.next_index = 0

    def __iter__(self) -> IndexedStream:
        return self

    def __next__(self) -> JaggedBatch:
        batch = self.make_global_batch(self.next_index)
        self.next_index += 1
        return local_share(batch, rank=self.rank, world_size=self.world_size,
                           balancer=self.balancer, cost_fn=self.cost_fn)

    def state_dict(self) -> dict[str, Any]:
        return {"next_index": self.next_index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_index = int(state["next_index"])

    def close(self) -> None:
        """Nothing runs in the background: batches are made on demand."""
