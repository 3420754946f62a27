"""What a data source gives the trainer: a schema, a resumable training stream, an eval split."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Protocol, Sequence

import torch

from gem_core.batch import JaggedBatch
from gem_core.schema import FeatureSchema

Balancer = Callable[[Sequence[float], int], list[list[int]]]
"""``(per-sample costs, number of ranks) -> sample indices per rank``; see the balancer hook."""


class TrainStream(Protocol):
    """This rank's share of each global training batch, in a deterministic order.

    ``state_dict()`` is the position after the last batch returned; loading it into a stream
    built with the same arguments continues with the exact next batch (resume).

    Resuming with another number of ranks: a position that is the same on every rank is taken to
    be global (e.g. the index of the next global batch) and is loaded on every new rank, so the
    run continues at the same global batch; a stream whose position is per rank must save
    something that differs between ranks (e.g. its rank) or refuse in ``load_state_dict`` with
    a ``GemDataError``, and the trainer then stops with an error naming the source.
    """

    def __iter__(self) -> Iterator[JaggedBatch]: ...

    def __next__(self) -> JaggedBatch: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None:
        """Stop and join any background work (e.g. threads reading ahead) and release files.
        The trainer calls it when the run ends, successfully or not, before the process group
        is destroyed; a stream without background work does nothing."""
        ...


class DataSource(Protocol):
    """Built by a registered factory ``(config: DataConfig, *, seed: int) -> DataSource``.

    ``schema`` declares the data's tables, event, candidate and context features and tasks
    (:class:`~gem_core.schema.FeatureSchema`); every batch it yields is a request-level
    :class:`~gem_core.batch.JaggedBatch` that passes ``batch.validate(schema)``."""

    schema: FeatureSchema

    def train_stream(
        self, *, batch_size: int, rank: int, world_size: int, balancer: Balancer,
        cost_fn: Callable[[JaggedBatch], Sequence[float]],
    ) -> TrainStream:
        """Global batches of ``batch_size`` requests (each with its ``K >= 1`` candidates),
        split across ranks by ``balancer`` applied to ``cost_fn(global_batch)`` (one cost per
        request); yields this rank's share."""
        ...

    def eval_batches(self, *, batch_size: int) -> Iterator[JaggedBatch]:
        """The whole held-out split, the same on every rank, in a fixed order."""
        ...

    def fingerprint(self) -> dict[str, str]:
        """What identifies the data beyond ``[data]`` and the seed (e.g. a digest of a data
        set's manifest, which changes when the data set is regenerated in place). Every
        checkpoint stores it and a resume on data with another fingerprint is refused. Data
        that is a pure function of the config and the seed (generated data) returns ``{}``."""
        ...


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


class IndexedStream:
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
