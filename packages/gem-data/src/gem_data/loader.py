"""The streaming loader: row groups -> shuffled windows -> batches, with an exact resume position.

A row is one request (format 2: its history and its candidates travel together, so a batch of
``batch_size`` rows is ``batch_size`` requests with however many candidates they hold).
An epoch is a seeded permutation of the split's units (row groups). Consecutive units form
*windows* of ``shuffle_window`` units; a window's rows are permuted with a seed of (seed, epoch,
window). The stream is the concatenation of the permuted windows, epoch after epoch, and a batch
is the next ``batch_size`` rows of it (or as many rows as fit in ``token_budget`` history events).
So the position after any batch is just ``(epoch, window, offset)``: a resumed stream re-reads
that window, skips ``offset`` rows and continues with exactly the rows an uninterrupted stream
would have produced. A background thread reads and checks the next ``prefetch`` windows
(``prefetch=0`` reads in the caller's thread, which is faster when the process has one core).

With ``shard=(rank, world_size)`` a rank reads only units ``rank, rank + world_size, ...`` of each
epoch's order: disjoint shards that together cover the epoch.
"""

from __future__ import annotations

import collections
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa

from gem_core.batch import JaggedBatch
from gem_core.contracts import TrainStream
from gem_core.errors import GemDataError
from gem_data.arrow_io import table_to_batch
from gem_data.batch_ops import RowGather, concat_batches, slice_batch
from gem_data.dataset import DatasetReader, Unit


class _Window:
    """A read, checked window decoded to one JaggedBatch, its row order, and the cumulative
    history tokens of its rows in that order."""

    def __init__(self, batch: JaggedBatch, order: np.ndarray | None) -> None:
        self.batch, self.order = batch, order
        self.gather = RowGather(batch) if order is not None else None
        lengths = batch.seq_lengths().numpy()
        if order is not None:
            lengths = lengths[order]
        self.cum_tokens = np.concatenate([[0], np.cumsum(lengths)])

    @property
    def rows(self) -> int:
        return self.batch.batch_size

    def rows_between(self, start: int, stop: int) -> JaggedBatch:
        if self.order is None:
            return slice_batch(self.batch, start, stop)
        return self.gather.take(self.order[start:stop])


class ParquetStream(TrainStream):
    """An iterator of JaggedBatch over one split, with ``state_dict``/``load_state_dict``."""

    def __init__(self, reader: DatasetReader, units: list[Unit], *, batch_size: int,
                 seed: int, token_budget: int = 0, shuffle: bool = True, shuffle_window: int = 1,
                 prefetch: int = 2, shard: tuple[int, int] | None = None,
                 epochs: int | None = None,
                 post: Callable[[JaggedBatch], JaggedBatch] | None = None) -> None:
        if not units:
            raise GemDataError(f"{reader.directory}: the split has no row groups to read")
        rank, world = shard or (0, 1)
        if len(units) < world:
            raise GemDataError(f"{reader.directory}: {len(units)} row groups cannot be sharded "
                               f"across {world} ranks; write smaller row groups")
        self.reader, self.units = reader, units
        self.batch_size, self.token_budget = batch_size, token_budget
        self.seed, self.shuffle, self.shuffle_window = seed, shuffle, max(1, shuffle_window)
        self.rank, self.world_size = rank, world
        self.epochs, self.post = epochs, post
        self.prefetch = max(0, prefetch)
        self._executor: ThreadPoolExecutor | None = None
        self._pending: collections.deque[tuple[tuple[int, int], Future]] = collections.deque()
        self._window: tuple[tuple[int, int], _Window] | None = None
        self.epoch, self.window, self.offset = 0, 0, 0

    # -- planning -----------------------------------------------------------------------------

    def epoch_units(self, epoch: int) -> list[Unit]:
        """This rank's units of ``epoch``, in reading order."""
        order = np.arange(len(self.units))
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.units))
        return [self.units[i] for i in order[self.rank::self.world_size]]

    def windows_per_epoch(self) -> int:
        count = len(range(self.rank, len(self.units), self.world_size))
        return -(-count // self.shuffle_window)

    def _next_key(self, key: tuple[int, int]) -> tuple[int, int]:
        epoch, window = key
        return (epoch, window + 1) if window + 1 < self.windows_per_epoch() else (epoch + 1, 0)

    def _read_window(self, epoch: int, window: int) -> _Window:
        units = self.epoch_units(epoch)[window * self.shuffle_window:
                                        (window + 1) * self.shuffle_window]
        table = pa.concat_tables([self.reader.read(u) for u in units])
        # Decode once per window (in this background thread); batches then gather rows with
        # numpy take, several times faster than arrow's take on list columns.
        batch = table_to_batch(table, self.reader.schema, self.reader.max_seq_len)
        order = None
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch, window]).permutation(table.num_rows)
        return _Window(batch, order)

    def _get_window(self, key: tuple[int, int]) -> _Window:
        if self._window is not None and self._window[0] == key:
            return self._window[1]
        if self.prefetch == 0:  # read in this thread: on one core a second thread only costs
            self._window = (key, self._read_window(*key))
            return self._window[1]
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="gem-data-prefetch")
        while self._pending and self._pending[0][0] != key:
            self._pending.popleft()[1].cancel()  # after a load_state_dict jump
        if not self._pending:
            self._pending.append((key, self._executor.submit(self._read_window, *key)))
        upcoming = self._pending[-1][0]
        while len(self._pending) < self.prefetch + 1:
            upcoming = self._next_key(upcoming)
            if self.epochs is not None and upcoming[0] >= self.epochs:
                break  # a finite stream (eval, benchmarks) reads nothing past its end
            self._pending.append((upcoming, self._executor.submit(self._read_window, *upcoming)))
        window = self._pending.popleft()[1].result()
        self._window = (key, window)
        return window

    # -- iteration ----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[JaggedBatch]:
        return self

    def __next__(self) -> JaggedBatch:
        pieces: list[Any] = []
        rows = tokens = empty = 0
        while True:
            if self.epochs is not None and self.epoch >= self.epochs:
                break
            window = self._get_window((self.epoch, self.window))
            start = self.offset
            if self.token_budget:
                base = window.cum_tokens[start]
                fit = int(np.searchsorted(window.cum_tokens[start + 1:] - base,
                                          self.token_budget - tokens, side="right"))
                if fit == 0 and rows == 0 and start < window.rows:
                    fit = 1  # a history longer than the budget still forms a batch of its own
                take = min(fit, window.rows - start)
            else:
                take = min(self.batch_size - rows, window.rows - start)
            empty = 0 if window.rows else empty + 1
            if empty > self.windows_per_epoch():
                raise GemDataError(f"{self.reader.directory}: no rows are left in a whole epoch "
                                   "after validation dropped the bad ones")
            if take:
                pieces.append(window.rows_between(start, start + take))
                rows += take
                tokens += int(window.cum_tokens[start + take] - window.cum_tokens[start])
            self.offset += take
            if self.offset >= window.rows:
                self.epoch, self.window = self._next_key((self.epoch, self.window))
                self.offset = 0
            full = (rows >= self.batch_size) if not self.token_budget else (
                start + take < window.rows or tokens >= self.token_budget)
            if full and rows:
                break
        if not rows:
            raise StopIteration
        batch = concat_batches(pieces)
        return self.post(batch) if self.post is not None else batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "window": self.window, "offset": self.offset,
                "units": len(self.units), "rank": self.rank, "world_size": self.world_size,
                "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A position only means the same rows for the same data, sharding and seed: refuse others.
        mine = self.state_dict()
        for key in ("units", "rank", "world_size", "seed"):
            if key in state and state[key] != mine[key]:
                raise GemDataError(f"cannot resume the data stream: saved {key} {state[key]!r} "
                                   f"differs from this run's {mine[key]!r}")
        self.epoch, self.window, self.offset = (int(state["epoch"]), int(state["window"]),
                                                int(state["offset"]))

    def close(self) -> None:
        for _, future in self._pending:
            future.cancel()
        self._pending.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def __del__(self) -> None:
        executor = getattr(self, "_executor", None)
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
