"""``synthetic-ads``: the full generator (``generator.py``) as an in-memory data source.

Training batch ``i`` is ``generator.chunk(batch_size, split="train", index=i)``, a pure function
of the seed, so the stream's position is one integer and resume is exact. The eval split is
generated once in fixed chunks, so it does not depend on the eval batch size. Use it to train on
the realistic ads log without writing files; ``gem data synth`` writes the same kind of data to
Parquet for the ``parquet`` source.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

from gem_core.batch import JaggedBatch
from gem_core.config import DataConfig, structure
from gem_core.data.api import Balancer, IndexedStream

from gem_data.batch_ops import concat_batches, slice_batch
from gem_data.generator import AdsLogGenerator, SynthOptions

EVAL_CHUNK_ROWS = 4096


class SyntheticAdsSource:
    """Generated ads impressions; ``[data.options]`` are :class:`SynthOptions` fields
    (``max_length`` defaults to ``data.max_seq_len``)."""

    def __init__(self, config: DataConfig, *, seed: int) -> None:
        self.config, self.seed = config, seed
        self.options = structure(SynthOptions, {"max_length": config.max_seq_len,
                                                **config.options}, "data.options")
        self.generator = AdsLogGenerator(self.options, seed=seed)
        self.schema = self.generator.schema
        self._eval: JaggedBatch | None = None
        self.rows_generated = 0

    def train_stream(self, *, batch_size: int, rank: int, world_size: int, balancer: Balancer,
                     cost_fn: Callable[[JaggedBatch], Sequence[float]]) -> IndexedStream:
        return IndexedStream(lambda index: self._train_chunk(batch_size, index), rank=rank,
                             world_size=world_size, balancer=balancer, cost_fn=cost_fn)

    def _train_chunk(self, batch_size: int, index: int) -> JaggedBatch:
        batch = self.generator.chunk(batch_size, split="train", index=index)
        self.rows_generated += batch.batch_size
        return batch

    def eval_batches(self, *, batch_size: int) -> Iterator[JaggedBatch]:
        if self._eval is None:
            rows = self.config.eval_rows
            self._eval = concat_batches([
                self.generator.chunk(min(EVAL_CHUNK_ROWS, rows - start), split="eval", index=i)
                for i, start in enumerate(range(0, rows, EVAL_CHUNK_ROWS))])
        for start in range(0, self._eval.batch_size, batch_size):
            yield slice_batch(self._eval, start, min(start + batch_size, self._eval.batch_size))

    def report(self) -> dict[str, Any]:
        return {"source": "synthetic-ads", "rows_generated": self.rows_generated,
                "rows_dropped": 0, "rows_repaired": 0}


def synthetic_ads_factory(config: DataConfig, *, seed: int) -> SyntheticAdsSource:
    return SyntheticAdsSource(config, seed=seed)
