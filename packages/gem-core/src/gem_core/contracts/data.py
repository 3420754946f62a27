"""Data (kinds ``data`` and ``balancer``): the source a ``data`` factory builds, its
training stream and time windows, and the function-like kinds' signatures."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import attrs

from gem_core.errors import GemConfigError

if TYPE_CHECKING:
    from gem_core.batch import JaggedBatch
    from gem_core.config import DataConfig
    from gem_core.schema import FeatureSchema


class TrainStream(abc.ABC):
    """This rank's share of each global training batch, in a deterministic order.

    ``state_dict()`` is the position after the last batch returned; loading it into a stream
    built with the same arguments continues with the exact next batch (resume).

    Resuming with another number of ranks: a position that is the same on every rank is taken to
    be global (e.g. the index of the next global batch) and is loaded on every new rank, so the
    run continues at the same global batch; a stream whose position is per rank must save
    something that differs between ranks (e.g. its rank) or refuse in ``load_state_dict`` with
    a ``GemDataError``, and the trainer then stops with an error naming the source.
    """

    def __iter__(self) -> Iterator[JaggedBatch]:
        return self

    @abc.abstractmethod
    def __next__(self) -> JaggedBatch: ...

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None:
        """Stop and join any background work (e.g. threads reading ahead) and release files.
        The trainer calls it when the run ends, successfully or not, before the process group
        is destroyed; a stream without background work does nothing (this default)."""
        return None


class DataSource(abc.ABC):
    """What a registered ``data`` factory ``(config: DataConfig, *, seed: int, options) ->
    DataSource`` builds (``options``: ``data.options`` typed, as the strategies' are): a
    feature schema, a deterministic stream of global training batches with a resumable
    position, and a fixed held-out evaluation split.

    ``schema`` declares the data's tables, event, candidate and context features and tasks
    (:class:`~gem_core.schema.FeatureSchema`); every batch it yields is a request-level
    :class:`~gem_core.batch.JaggedBatch` that passes ``batch.validate(schema)``."""

    schema: FeatureSchema

    @abc.abstractmethod
    def train_stream(self, *, batch_size: int, rank: int, world_size: int,
                     balancer: Callable[[Sequence[float], int], list[list[int]]],
                     cost_fn: Callable[[JaggedBatch], Sequence[float]]) -> TrainStream:
        """Global batches of ``batch_size`` requests (each with its ``K >= 1`` candidates),
        split across ranks by ``balancer`` applied to ``cost_fn(global_batch)`` (one cost per
        request); yields this rank's share."""

    @abc.abstractmethod
    def eval_batches(self, *, batch_size: int) -> Iterator[JaggedBatch]:
        """The whole held-out split, the same on every rank, in a fixed order."""

    @abc.abstractmethod
    def fingerprint(self) -> dict[str, Any]:
        """What identifies the data beyond ``[data]`` and the seed (e.g. a digest of a data
        set's manifest, which changes when the data set is regenerated in place). Every
        checkpoint stores it and a resume on data with another fingerprint is refused. Data
        that is a pure function of the config and the seed (generated data) returns ``{}``."""

    def applied_config(self, given: DataConfig) -> DataConfig:
        """``[data]`` as this source applies it (``given``: what its factory was called with),
        which the run records in its ``config.toml`` and checkpoints and builds everything else
        from. A file-backed source puts its data set's own values in place of those
        ``given.data_set_wins`` names (the parquet source: the manifest's ``max_seq_len``, no
        ``eval_rows`` cap); this default applies ``given`` as it is (generated data), with
        that list emptied."""
        return attrs.evolve(given, data_set_wins=())

    def raw_id(self, feature: str, text: str) -> int:
        """The raw id this source's data uses for the category ``text`` of the event feature
        ``feature`` (what ``batch.event_ids[feature]`` holds for it), for settings given as
        text (``model.view_action = "pv"``), which the trainer resolves at start-up. Raises
        :class:`~gem_core.errors.GemConfigError` naming the feature (and, where the source has
        them, its table, the file and the values) when ``feature`` is not an event feature,
        has no vocabulary of texts, or ``text`` is not one of them. This default: the source
        has no string vocabularies, so every text is refused."""
        raise GemConfigError(
            f"event feature {feature!r}: {text!r} is text, and data source "
            f"{type(self).__name__} has no string vocabularies to look it up in; give the raw "
            "id (an integer) instead")

    def requests_per_pass(self) -> int | None:
        """Training requests in one pass over the training data, where global batches of
        ``train.batch_size`` requests run on from one pass into the next (so ``train.epochs``
        passes end in step ``ceil(epochs * requests / batch_size)``); None where that is not
        known before training: generated data (no passes), batches cut by a token budget,
        ranks reading data of their own. The trainer ends its learning-rate schedule with the
        last pass where that comes before ``train.steps``. This default: None."""
        return None

    def report(self) -> dict[str, Any]:
        """Counts for ``summary.json`` under ``data`` and the log (``rows_checked``,
        ``rows_dropped``, ``rows_repaired`` per check, ``histories_truncated``: see
        :mod:`gem_core.train.data_log`); a source that checks nothing reports ``{}``."""
        return {}


class WindowedSource(DataSource):
    """A data source whose training data is divided into time windows, oldest first, and that
    can stream them in time order (capability ``time_windows``; ``data.order = "time"``).

    With ``data.order = "time"``, ``train_stream`` reads the windows once, in order, ending
    every window with a batch of its own (a window's last batch may be short), so no batch mixes
    two windows; it raises ``StopIteration`` after the last window. Its position (the
    ``state_dict()``) stays valid when the data set gains windows after the last one read: a
    run stopped at the end of the data continues with the new windows. ``fingerprint()`` then
    holds ``windows``: ``"name=digest;name=digest..."`` of the windows in order, which a
    checkpoint's must be the start of (a data set that gained windows is the same data,
    continued)."""

    @abc.abstractmethod
    def windows(self) -> Sequence[DataWindow]:
        """The time windows, oldest first; empty when the data is not divided into windows."""

    @abc.abstractmethod
    def window_at(self, position: Mapping[str, Any]) -> tuple[int, bool]:
        """For a time-order training stream's ``position`` (its ``state_dict()``): the index
        of the window its next batch comes from (``len(windows())`` once every window has been
        read) and whether that window has been begun (some of its requests already read)."""

    @abc.abstractmethod
    def window_eval_batches(self, index: int, *, batch_size: int) -> Iterator[JaggedBatch]:
        """Window ``index``'s requests (all of them, or its first ``data.eval_rows`` when set),
        in file order, the same on every rank: what progressive evaluation scores before
        training on the window."""


class DataWindow:
    """One time window of a :class:`WindowedSource`: its name, requests and time range
    (``request_timestamp`` seconds)."""

    __slots__ = ("name", "rows", "first_time", "last_time")

    def __init__(self, *, name: str, rows: int, first_time: int, last_time: int) -> None:
        self.name, self.rows = name, rows
        self.first_time, self.last_time = first_time, last_time

    def __repr__(self) -> str:
        return (f"DataWindow(name={self.name!r}, rows={self.rows}, first_time={self.first_time}, "
                f"last_time={self.last_time})")


DataFactory = Callable[..., DataSource]
"""``(config: DataConfig, *, seed: int, options) -> DataSource``: what a ``data`` spec's
``load()`` returns (``options``: ``data.options`` structured into the spec's options class, or
None)."""

Balancer = Callable[[Sequence[float], int], list[list[int]]]
"""``(per-sample costs, number of ranks) -> sample indices per rank`` (kind ``balancer``): every
index exactly once, deterministic for the same input."""
