"""How the trainer's steps get their batches: one at a time from the training stream
(:class:`gem_core.contracts.PlainSteps`, the default), or through a pipeline an
embedding-sharding strategy builds (:meth:`gem_core.contracts.EmbeddingSharding.step_runner`,
e.g. TorchRec's train pipelines, which distribute the sparse inputs of the next batch while this one
computes).

A pipeline fetches batches before it trains them, so the stream's own position runs ahead of
training. :class:`PositionedBatches` records the stream's position right after each batch it
hands out; a runner reports the one of the last batch *trained*, so a checkpoint resumes exactly
at the first untrained batch and the batches that were only prefetched are fetched again.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator

import attrs

from gem_core.batch import JaggedBatch
from gem_core.contracts import TrainStream


@attrs.frozen(kw_only=True)
class PositionedBatch:
    """A training batch and where the stream stood right after it."""

    batch: JaggedBatch
    """The batch as the stream returned it."""
    position: dict[str, Any]
    """The stream's ``state_dict()`` right after returning ``batch`` (a copy): the data position
    to checkpoint once ``batch`` is trained."""


class PositionedBatches(Iterator[PositionedBatch]):
    """The stream's batches, each with the stream's position right after it (see the module
    docstring). ``data_position()`` is the position after the last batch marked trained with
    :meth:`trained`, or the stream's own before any."""

    def __init__(self, stream: TrainStream) -> None:
        self.stream = stream
        self._trained: dict[str, Any] | None = None

    def __next__(self) -> PositionedBatch:
        batch = next(self.stream)
        # A copy: a stream may update its state in place as it reads on.
        return PositionedBatch(batch=batch, position=copy.deepcopy(self.stream.state_dict()))

    def trained(self, batch: PositionedBatch) -> None:
        self._trained = batch.position

    def data_position(self) -> dict[str, Any]:
        return self._trained if self._trained is not None else self.stream.state_dict()
