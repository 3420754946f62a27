"""The ``parquet`` data source: a format 2 data set directory (one row per request, see
docs/data-format.md) behind gem-core's DataSource contract. A format 1 data set is refused with
a message naming ``gem data convert OLD --out NEW``, which rewrites it as format 2.

Sharding (``[data.options] sharding``):

* ``global`` (default): every rank streams the same global batches (same seed, same order) and
  keeps its share chosen by the run's batch balancer (:func:`gem_core.data.api.local_share`), so
  cost balancing works. Each rank reads all row groups; at 10+ M events/s per core that is far
  above what a GPU consumes, and it needs no communication.
* ``row_groups``: rank ``r`` reads only row groups ``r, r + W, ...`` of each epoch's order (disjoint
  shards that cover the epoch) and forms local batches of ``batch_size / W`` requests. Reads 1/W of
  the data, but balancing across ranks is not possible without the global batch, so the balancer
  is not applied; use it when reading, not attention cost, is the bottleneck.

With ``data.order = "time"`` the source streams a data set's time windows once, oldest first
(:mod:`gem_data.time_stream`), evaluates window by window (:meth:`ParquetSource.
window_eval_batches`) and holds nothing out; its fingerprint lists the windows, so a data set
that gained windows is the same data continued.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import attrs

from gem_core.batch import JaggedBatch
from gem_core.config import DataConfig
from gem_core.config.validators import at_least, choice, greater_than
from gem_core.contracts import DataWindow, WindowedSource
from gem_core.data.api import Balancer, local_share
from gem_core.errors import GemConfigError, GemDataError
from gem_data.batch_ops import slice_batch
from gem_data.dataset import DatasetReader, Unit, split_units, warn_without_digests
from gem_data.loader import ParquetStream
from gem_data.manifest import Manifest, read_manifest
from gem_data.source_config import applied_data_config, log_applied
from gem_data.time_stream import TimeOrderedStream
from gem_data.validation import ValidationPolicy, ValidationReport

log = logging.getLogger(__name__)

#: Values of a vocabulary an error lists when a text is not among them (the first ones, sorted).
SHOWN_VALUES = 20


@attrs.frozen(kw_only=True)
class ParquetOptions:
    """``[data.options]`` of the ``parquet`` source (``data.path`` is the data set directory)."""

    shuffle: bool = True
    """Shuffle row groups per epoch and rows within each shuffle window."""

    shuffle_window: int = attrs.field(default=1, validator=greater_than(0))
    """Row groups whose rows are shuffled together. One keeps gathers cache-friendly; row groups
    are already visited in a random order every epoch."""

    prefetch: int = attrs.field(default=2, validator=at_least(0))
    """Windows read and checked ahead by a background thread; 0 reads in the training thread
    (faster when the process has a single core, since nothing can overlap)."""

    token_budget: int = attrs.field(default=0, validator=at_least(0))
    """If > 0, a global batch is as many requests as fit in this many history events (after
    truncation) instead of ``train.batch_size`` requests."""

    sharding: str = attrs.field(default="global", validator=choice("global", "row_groups"))
    """How ranks split the data; see the module documentation."""

    validation: ValidationPolicy = attrs.field(factory=ValidationPolicy)
    """Per-check policy for bad requests (``error``, ``drop``, ``clamp``, ``trim``; see
    :class:`gem_data.validation.ValidationPolicy`)."""


class ParquetSource(WindowedSource):
    """A data set directory as a :class:`gem_core.data.DataSource`."""

    name = "parquet"

    def __init__(self, config: DataConfig, *, seed: int, options: ParquetOptions,
                 directory: str | Path | None = None) -> None:
        self.seed = seed
        self.options = options
        location = directory if directory is not None else config.path
        if not location:
            raise GemDataError(f"data source {self.name!r} needs data.path: a data set directory "
                               "(make one with `gem data synth --out DIR`)")
        self.directory = Path(location)
        self.manifest = read_manifest(self.directory)
        warn_without_digests(self.directory, self.manifest)
        # The data set's own max_seq_len and eval split replace values the user did not choose.
        own = self.manifest.schema.max_seq_len
        self.config = applied_data_config(config, own)
        log_applied(config, self.config, own, self.directory)
        self.max_seq_len = self.config.max_seq_len
        self.schema = attrs.evolve(self.manifest.schema, max_seq_len=self.max_seq_len)
        self._report = ValidationReport()
        self.time_order = config.order == "time"
        if self.time_order and not self.manifest.windows:
            raise GemDataError(
                f"data.order = 'time' reads a data set's time windows, and {self.directory} has "
                "none: import logs with `gem data import --window NAME` (then `--append`), or "
                "write one with `gem data synth --windows N`")
        if self.time_order and self.options.sharding == "row_groups":
            raise GemDataError(
                "data.order = 'time' with [data.options] sharding = 'row_groups': ranks reading "
                "disjoint row groups would end a window after different numbers of steps; use "
                "sharding = 'global'")
        self.train_units, self.eval_units = self._plan_splits()

    def requests_per_pass(self) -> int | None:
        # Known where every rank reads the same global batches of whole requests: not with a
        # token budget (requests per batch vary), not with row-group sharding (each rank's
        # pass is its own), not in time order (one pass over windows, planned by the trainer).
        if self.time_order or self.options.token_budget or self.options.sharding != "global":
            return None
        return sum(unit.rows for unit in self.train_units)

    def _plan_splits(self) -> tuple[list[Unit], list[Unit]]:
        train = split_units(self.manifest, "train")
        if self.time_order:  # every window trains; each is evaluated before it is trained on
            return train, split_units(self.manifest, "eval")
        if self.manifest.splits.get("eval"):
            return train, split_units(self.manifest, "eval")
        # No eval files: hold out trailing row groups (at least eval_rows rows, or 8192 when
        # unset; never all).
        wanted = self.config.generated_eval_rows
        held, rows = [], 0
        while rows < wanted and len(train) > 1:
            held.insert(0, train.pop())
            rows += held[0].rows
        if not held:
            raise GemDataError(f"{self.directory}: no eval split and only one row group; "
                               "write an eval split or smaller row groups")
        log.info("%s has no eval split: its last %d row groups (%d requests, at least %d: "
                 "data.eval_rows%s) are held out for evaluation", self.directory, len(held), rows,
                 wanted, " unset" if self.config.eval_rows is None else "")
        return train, held

    def applied_config(self, given: DataConfig) -> DataConfig:
        """``given`` with the data set's own ``max_seq_len`` and whole eval split where
        ``given.data_set_wins`` names them (see :mod:`gem_data.source_config`)."""
        return applied_data_config(given, self.manifest.schema.max_seq_len)

    def raw_id(self, feature: str, text: str) -> int:
        """The id ``text`` has in the vocabulary of ``feature``'s table, which the data set was
        imported with (``[import.strings] TABLE = "vocabulary"``: its manifest's
        ``info.vocabularies``, file ``vocabulary.TABLE.json``)."""
        from gem_data.import_strings import read_vocabulary

        tables = {f.name: f.table for f in self.schema.event_features}
        if feature not in tables:
            raise GemConfigError(f"{feature!r} is not an event feature of {self.directory}; its "
                                 f"event features: {', '.join(tables)}")
        table = tables[feature]
        entry = (self.manifest.info.get("vocabularies") or {}).get(table)
        if entry is None:
            raise GemConfigError(
                f"event feature {feature!r} (table {table!r}) has no vocabulary of texts in "
                f"{self.directory / 'manifest.json'} (the data set was not imported with "
                f"[import.strings] {table} = \"vocabulary\"), so {text!r} cannot be looked up; "
                "give the raw id (an integer) instead")
        vocabulary = read_vocabulary(self.directory, table, entry)
        found = vocabulary.id_of(text)
        if found is None:
            shown = ", ".join(repr(v) for v in vocabulary.values[:SHOWN_VALUES])
            more = (f", ... ({len(vocabulary.values)} in all)"
                    if len(vocabulary.values) > SHOWN_VALUES else "")
            raise GemConfigError(
                f"{text!r} is not in the vocabulary of event feature {feature!r} (table "
                f"{table!r}, {self.directory / entry['path']}); its values: {shown}{more}")
        return found

    def _reader(self) -> DatasetReader:
        return DatasetReader(self.directory, policy=self.options.validation, report=self._report,
                             max_seq_len=self.max_seq_len, manifest=self.manifest)

    def train_stream(self, *, batch_size: int, rank: int, world_size: int, balancer: Balancer,
                     cost_fn: Callable[[JaggedBatch], Sequence[float]]) -> ParquetStream:
        o = self.options
        common = dict(seed=self.seed, shuffle=o.shuffle, shuffle_window=o.shuffle_window,
                      prefetch=o.prefetch)
        if o.sharding == "row_groups" and world_size > 1:
            local = batch_size // world_size + (1 if rank < batch_size % world_size else 0)
            return ParquetStream(self._reader(), self.train_units, batch_size=max(local, 1),
                                 token_budget=-(-o.token_budget // world_size),
                                 shard=(rank, world_size), **common)
        post = functools.partial(local_share, rank=rank, world_size=world_size,
                                 balancer=balancer, cost_fn=cost_fn)
        if self.time_order:
            return TimeOrderedStream(self._reader(), self._window_units(),
                                     batch_size=batch_size, token_budget=o.token_budget,
                                     post=post, **common)
        return ParquetStream(self._reader(), self.train_units, batch_size=batch_size,
                             token_budget=o.token_budget, post=post, **common)

    def eval_batches(self, *, batch_size: int) -> Iterator[JaggedBatch]:
        """The eval split (its first ``data.eval_rows`` requests when set), in file order, on
        every rank."""
        if not self.eval_units:
            raise GemDataError(f"{self.directory} has no eval split: in data.order = 'time' "
                               "every window trains, and each is evaluated before it is trained "
                               "on (progressive evaluation)")
        return self._first_rows(self.eval_units, batch_size)

    def _first_rows(self, units: list[Unit], batch_size: int) -> Iterator[JaggedBatch]:
        """The requests of ``units`` (the first ``data.eval_rows`` when set), in file order."""
        stream = ParquetStream(self._reader(), units, batch_size=batch_size,
                               seed=self.seed, shuffle=False, epochs=1,
                               prefetch=self.options.prefetch)
        remaining = self.config.eval_rows
        try:
            if remaining is None:  # the whole split
                yield from stream
                return
            for batch in stream:
                if batch.batch_size > remaining:
                    batch = slice_batch(batch, 0, remaining)
                remaining -= batch.batch_size
                yield batch
                if remaining <= 0:
                    return
        finally:
            stream.close()

    # -- time windows ---------------------------------------------------------------------------

    def windows(self) -> list[DataWindow]:
        return [DataWindow(name=w.name, rows=self.manifest.window_rows(w),
                           first_time=w.first_time, last_time=w.last_time)
                for w in self.manifest.windows]

    def _window_units(self) -> list[tuple[str, list[Unit]]]:
        by_file: dict[str, list[Unit]] = {}
        for unit in self.train_units:
            by_file.setdefault(unit.file, []).append(unit)
        return [(w.name, [u for path in w.files for u in by_file[path]])
                for w in self.manifest.windows]

    def window_at(self, position: Any) -> tuple[int, bool]:
        if not isinstance(position, dict) or position.get("order") != "time":
            raise GemDataError(f"not a time-order stream position: {position!r}")
        return int(position["window_index"]), bool(position["begun"])

    def window_eval_batches(self, index: int, *, batch_size: int) -> Iterator[JaggedBatch]:
        """Window ``index``'s requests (the first ``data.eval_rows`` when set), in file
        order."""
        return self._first_rows(self._window_units()[index][1], batch_size)

    def fingerprint(self) -> dict[str, str]:
        """The manifest's digest: its files, row counts, schema and provenance (generator
        options and seed) change when the data set is rewritten in place. In time order: the
        schema's digest and each window's (its name and files), so that a data set that gained
        windows continues the data a checkpoint was trained on."""
        if self.time_order:
            return {"schema_sha256": _digest(self.manifest.to_dict()["schema"]),
                    "windows": _window_digests(self.manifest)}
        return {"manifest_sha256": _digest(self.manifest.to_dict())}

    def report(self) -> dict[str, Any]:
        """Counts of checked, dropped, repaired and truncated rows, for the run's summary."""
        return {"source": self.name, "path": str(self.directory),
                "train_split_rows": sum(u.rows for u in self.train_units),
                "eval_split_rows": sum(u.rows for u in self.eval_units),
                **self._report.to_dict()}


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _window_digests(manifest: Manifest) -> str:
    """``name=digest;...`` of the windows in order; a window's digest covers its files' paths,
    row groups and SHA-256s."""
    entries = {entry.path: entry for entry in manifest.splits["train"]}

    def files(window: Any) -> list[list[Any]]:
        return [[p, list(entries[p].row_groups), entries[p].sha256] for p in window.files]

    return ";".join(f"{w.name}={_digest(files(w))}" for w in manifest.windows)


def parquet_factory(config: DataConfig, *, seed: int, options: ParquetOptions) -> ParquetSource:
    return ParquetSource(config, seed=seed, options=options)
