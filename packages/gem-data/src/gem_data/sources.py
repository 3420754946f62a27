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
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import attrs

from gem_core.batch import JaggedBatch
from gem_core.config import DataConfig, structure
from gem_core.config.validators import at_least, choice, greater_than
from gem_core.data.api import Balancer, DataSource, local_share
from gem_core.errors import GemDataError
from gem_data.batch_ops import slice_batch
from gem_data.dataset import DatasetReader, Unit, split_units, warn_without_digests
from gem_data.loader import ParquetStream
from gem_data.manifest import read_manifest
from gem_data.validation import ValidationPolicy, ValidationReport


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


class ParquetSource(DataSource):
    """A data set directory as a :class:`gem_core.data.DataSource`."""

    name = "parquet"

    def __init__(self, config: DataConfig, *, seed: int, options: ParquetOptions | None = None,
                 directory: str | Path | None = None) -> None:
        self.config, self.seed = config, seed
        self.options = options or structure(ParquetOptions, config.options, "data.options")
        location = directory if directory is not None else config.path
        if not location:
            raise GemDataError(f"data source {self.name!r} needs data.path: a data set directory "
                               "(make one with `gem data synth --out DIR`)")
        self.directory = Path(location)
        self.manifest = read_manifest(self.directory)
        warn_without_digests(self.directory, self.manifest)
        self.max_seq_len = min(config.max_seq_len, self.manifest.schema.max_seq_len)
        self.schema = attrs.evolve(self.manifest.schema, max_seq_len=self.max_seq_len)
        self._report = ValidationReport()
        self.train_units, self.eval_units = self._plan_splits()

    def _plan_splits(self) -> tuple[list[Unit], list[Unit]]:
        train = split_units(self.manifest, "train")
        if self.manifest.splits.get("eval"):
            return train, split_units(self.manifest, "eval")
        # No eval files: hold out trailing row groups (at least eval_rows rows, never all).
        held, rows = [], 0
        while rows < self.config.eval_rows and len(train) > 1:
            held.insert(0, train.pop())
            rows += held[0].rows
        if not held:
            raise GemDataError(f"{self.directory}: no eval split and only one row group; "
                               "write an eval split or smaller row groups")
        return train, held

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
        return ParquetStream(self._reader(), self.train_units, batch_size=batch_size,
                             token_budget=o.token_budget, post=post, **common)

    def eval_batches(self, *, batch_size: int) -> Iterator[JaggedBatch]:
        """The first ``data.eval_rows`` requests of the eval split, in file order, on every
        rank."""
        stream = ParquetStream(self._reader(), self.eval_units, batch_size=batch_size,
                               seed=self.seed, shuffle=False, epochs=1,
                               prefetch=self.options.prefetch)
        remaining = self.config.eval_rows
        try:
            for batch in stream:
                if batch.batch_size > remaining:
                    batch = slice_batch(batch, 0, remaining)
                remaining -= batch.batch_size
                yield batch
                if remaining <= 0:
                    return
        finally:
            stream.close()

    def fingerprint(self) -> dict[str, str]:
        """The manifest's digest: its files, row counts, schema and provenance (generator
        options and seed) change when the data set is rewritten in place."""
        canonical = json.dumps(self.manifest.to_dict(), sort_keys=True).encode()
        return {"manifest_sha256": hashlib.sha256(canonical).hexdigest()}

    def report(self) -> dict[str, Any]:
        """Counts of checked, dropped, repaired and truncated rows, for the run's summary."""
        return {"source": self.name, "path": str(self.directory),
                "train_split_rows": sum(u.rows for u in self.train_units),
                "eval_split_rows": sum(u.rows for u in self.eval_units),
                **self._report.to_dict()}


def parquet_factory(config: DataConfig, *, seed: int) -> ParquetSource:
    return ParquetSource(config, seed=seed)
