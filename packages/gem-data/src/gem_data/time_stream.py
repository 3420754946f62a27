"""The training stream of ``data.order = "time"``: a data set's time windows read once, oldest
first, each window a :class:`~gem_data.loader.ParquetStream` of one pass.

Inside a window, row groups and rows are shuffled as ``[data.options]`` says (with a seed of
(run seed, window index), so a window reads the same whichever run reaches it); across windows
the order is time. A window's last batch holds what is left of it, so no batch mixes two windows
and the trainer can evaluate the next window before training on it. The position is ``(window,
position inside it)``; after the last window it is ``(len(windows), start)``, which stays valid
when the data set gains windows: the run continues with the first new one.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from gem_core.batch import JaggedBatch
from gem_core.contracts import TrainStream
from gem_core.errors import GemDataError
from gem_data.dataset import DatasetReader, Unit
from gem_data.loader import ParquetStream


def window_seed(seed: int, index: int) -> int:
    """The shuffling seed of window ``index`` of a run seeded ``seed``."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


class TimeOrderedStream(TrainStream):
    """Windows in order, one pass each; ``state_dict``/``load_state_dict`` as the contract says.

    ``windows`` holds each window's name and row groups (units)."""

    def __init__(self, reader: DatasetReader, windows: list[tuple[str, list[Unit]]], *,
                 batch_size: int, seed: int, token_budget: int = 0, shuffle: bool = True,
                 shuffle_window: int = 1, prefetch: int = 2,
                 post: Callable[[JaggedBatch], JaggedBatch] | None = None) -> None:
        self.reader, self.windows = reader, windows
        self.seed = seed
        self._args = dict(batch_size=batch_size, token_budget=token_budget, shuffle=shuffle,
                          shuffle_window=shuffle_window, prefetch=prefetch, epochs=1, post=post)
        self.index = 0
        self._inner: ParquetStream | None = None
        self._inner_state: dict[str, Any] | None = None  # loaded, for the next inner stream

    def _open(self) -> ParquetStream:
        if self._inner is None:
            _, units = self.windows[self.index]
            self._inner = ParquetStream(self.reader, units, seed=window_seed(self.seed,
                                                                             self.index),
                                        **self._args)
            if self._inner_state is not None:
                self._inner.load_state_dict(self._inner_state)
                self._inner_state = None
        return self._inner

    def _next_window(self) -> None:
        if self._inner is not None:
            self._inner.close()
        self._inner, self._inner_state = None, None
        self.index += 1

    def __next__(self) -> JaggedBatch:
        while self.index < len(self.windows):
            try:
                batch = next(self._open())
            except StopIteration:
                self._next_window()
                continue
            if self._inner.epoch >= 1:  # the window's last batch: the next one starts a window
                self._next_window()
            return batch
        raise StopIteration

    def begun(self) -> bool:
        """Whether some of the current window has been read."""
        state = self._inner.state_dict() if self._inner is not None else self._inner_state
        return bool(state) and (state["window"], state["offset"]) != (0, 0)

    def state_dict(self) -> dict[str, Any]:
        inner = (self._inner.state_dict() if self._inner is not None else self._inner_state)
        name = self.windows[self.index][0] if self.index < len(self.windows) else None
        return {"order": "time", "window_index": self.index, "window_name": name,
                "inner": inner, "seed": self.seed, "begun": self.begun()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("order") != "time":
            raise GemDataError("cannot resume the data stream in time order from a position "
                               "saved in shuffled order (data.order changed)")
        if state.get("seed") != self.seed:
            raise GemDataError(f"cannot resume the data stream: saved seed {state.get('seed')!r}"
                               f" differs from this run's {self.seed!r}")
        index = int(state["window_index"])
        if index > len(self.windows):
            raise GemDataError(f"cannot resume the data stream at window {index}: the data set "
                               f"has {len(self.windows)} windows (windows were removed?)")
        name = state.get("window_name")
        if index < len(self.windows) and name is not None and self.windows[index][0] != name:
            raise GemDataError(f"cannot resume the data stream: window {index} was "
                               f"{name!r} and is now {self.windows[index][0]!r}")
        if self._inner is not None:
            self._inner.close()
        self.index, self._inner = index, None
        self._inner_state = state.get("inner") if index < len(self.windows) else None

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()
