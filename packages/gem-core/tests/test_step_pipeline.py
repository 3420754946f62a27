"""The trainer's step runners: the default one step at a time, and the data position a pipeline
reports when it has fetched batches ahead of the one it trained."""

from __future__ import annotations

from typing import Any

from gem_core.contracts import PlainSteps, TrainStream
from gem_core.train.step_pipeline import PositionedBatches


class CountingStream(TrainStream):
    """Batches 0, 1, 2, ... (ints stand in for batches); its position is the next one's index,
    kept in one dict updated in place, as a stream reading ahead might."""

    def __init__(self) -> None:
        self.state = {"next": 0}

    def __next__(self) -> Any:
        batch = self.state["next"]
        self.state["next"] += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = dict(state)


def test_plain_steps_train_each_batch_and_report_the_streams_position():
    stream = CountingStream()
    steps = PlainSteps(stream)
    assert [steps.run_step(lambda batch: {"batch": batch}) for _ in range(3)] == \
        [{"batch": 0}, {"batch": 1}, {"batch": 2}]
    assert steps.data_position() == {"next": 3}


def test_positioned_batches_report_the_position_after_the_last_batch_trained():
    stream = CountingStream()
    batches = PositionedBatches(stream)
    assert batches.data_position() == {"next": 0}  # before any: the stream's own
    fetched = [next(batches) for _ in range(3)]  # a pipeline fetched 3 and trained 1
    assert [b.batch for b in fetched] == [0, 1, 2]
    assert [b.position for b in fetched] == [{"next": 1}, {"next": 2}, {"next": 3}]
    batches.trained(fetched[0])
    assert batches.data_position() == {"next": 1}
    assert stream.state_dict() == {"next": 3}
    batches.trained(fetched[1])
    assert batches.data_position() == {"next": 2}
