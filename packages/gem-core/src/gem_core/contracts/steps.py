"""How the trainer's steps get their batches from the training stream: the runner an
embedding-sharding strategy may build (:meth:`gem_core.contracts.EmbeddingSharding.step_runner`)
and the default that fetches nothing ahead."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from gem_core.batch import JaggedBatch
    from gem_core.contracts.data import TrainStream


class StepRunner(abc.ABC):
    """Runs the trainer's steps over the training stream (what
    :meth:`EmbeddingSharding.step_runner` returns). A runner may fetch batches ahead of the one
    it trains (a pipeline); :meth:`data_position` is then still the stream's position right
    after the last batch *trained*, so a checkpoint resumes with the exact next batch
    (:class:`gem_core.train.step_pipeline.PositionedBatches` records it)."""

    @abc.abstractmethod
    def run_step(self, step: Callable[[JaggedBatch], dict[str, Any]]) -> dict[str, Any]:
        """Run ``step`` (forward, loss, backward and optimizer step of one batch, returning its
        metrics record) on the next batch and return its record. Every rank calls it together."""

    @abc.abstractmethod
    def data_position(self) -> dict[str, Any]:
        """The stream's ``state_dict()`` as it was right after the last batch trained (before
        any step: the stream's own)."""


class PlainSteps(StepRunner):
    """The default :class:`StepRunner`: each step on the stream's next batch; nothing is fetched
    ahead, so the data position is the stream's own."""

    def __init__(self, stream: TrainStream) -> None:
        self.stream = stream

    def run_step(self, step: Callable[[JaggedBatch], dict[str, Any]]) -> dict[str, Any]:
        return step(next(self.stream))

    def data_position(self) -> dict[str, Any]:
        return self.stream.state_dict()
