"""``synthetic-ads``: the full generator (``generator.py``) as an in-memory data source.

Training batch ``i`` is ``generator.chunk(batch_size, split="train", index=i)`` (``batch_size``
requests, each with its own number of candidates), a pure function of the seed, so the stream's
position is one integer and resume is exact. The eval split is generated in fixed chunks
(:data:`gem_data.generator.EVAL_CHUNK_ROWS`), so it does not depend on the eval batch size and
is the split :func:`gem_data.generator.achievable_ne` (and
:func:`gem_data.indicator_ne.indicator_regression_ne`) measures. Use it to train on the realistic
ads log without writing files; ``gem data synth`` writes the same kind of data to Parquet for
the ``parquet`` source.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import attrs
import torch

from gem_core.batch import JaggedBatch
from gem_core.config import DataConfig
from gem_core.config.validators import at_least
from gem_core.data.api import Balancer, DataSource, IndexedStream
from gem_data.generator import AdsLogGenerator, achievable_entries, achievable_figures
from gem_data.indicator_ne import TRAIN_ROWS, indicator_regression_ne
from gem_data.synth_options import SynthOptions


@attrs.frozen(kw_only=True)
class SyntheticAdsOptions(SynthOptions):
    """``[data.options]`` of ``synthetic-ads``: the generator's options (those of ``gem data
    synth``), with the longest history following ``data.max_seq_len``."""

    max_length: int = attrs.field(default=0, validator=at_least(0))
    """Longest history generated; longer draws keep their most recent events. 0:
    ``data.max_seq_len``."""


class SyntheticAdsSource(DataSource):
    """Generated ads requests; ``[data.options]`` are :class:`SyntheticAdsOptions`."""

    def __init__(self, config: DataConfig, *, seed: int, options: SyntheticAdsOptions) -> None:
        self.config, self.seed = config, seed
        self.options = SynthOptions(**{**attrs.asdict(options, recurse=False),
                                       "max_length": options.max_length or config.max_seq_len})
        if self.options.data_seed >= 0:
            self.seed = self.options.data_seed
        self.generator = AdsLogGenerator(self.options, seed=self.seed)
        self.schema = self.generator.schema
        self.rows_generated = 0
        self._achievable: dict[str, dict[str, float]] | None = None
        self._indicator: dict[str, float] | None = None

    def train_stream(self, *, batch_size: int, rank: int, world_size: int, balancer: Balancer,
                     cost_fn: Callable[[JaggedBatch], Sequence[float]]) -> IndexedStream:
        return IndexedStream(lambda index: self._train_chunk(batch_size, index), rank=rank,
                             world_size=world_size, balancer=balancer, cost_fn=cost_fn)

    def _train_chunk(self, batch_size: int, index: int) -> JaggedBatch:
        batch = self.generator.chunk(batch_size, split="train", index=index)
        self.rows_generated += batch.batch_size
        return batch

    def fingerprint(self) -> dict[str, str]:
        """Generated data is a function of ``[data]`` and the seed: nothing more to record."""
        return {}

    def eval_batches(self, *, batch_size: int) -> Iterator[JaggedBatch]:
        for index, size in self.generator.eval_chunks(self.config.generated_eval_rows):
            chunk = self.generator.chunk(size, split="eval", index=index)
            if batch_size >= size:
                yield chunk
                continue
            for start in range(0, size, batch_size):
                yield chunk.select(torch.arange(start, min(start + batch_size, size)))

    def achievable_ne(self) -> dict[str, float]:
        """Per task, the NE of the true label probabilities on this source's eval split."""
        return {task: figures["ne"] for task, figures in self.achievable_figures().items()}

    def achievable_figures(self) -> dict[str, dict[str, float]]:
        """Per task, the NE, AUC and GAUC of the true label probabilities on this source's eval
        split (:func:`gem_data.generator.achievable_figures`), computed once."""
        if self._achievable is None:
            self._achievable = achievable_figures(self.generator,
                                                  self.config.generated_eval_rows)
        return self._achievable

    def indicator_ne(self) -> dict[str, float]:
        """Per task, the NE on this source's eval split of a logistic regression on the planted
        kind's indicators, fitted on the first
        :data:`~gem_data.indicator_ne.TRAIN_ROWS` training requests."""
        if self._indicator is None:
            self._indicator = indicator_regression_ne(self.generator, TRAIN_ROWS,
                                                      self.config.generated_eval_rows)
        return self._indicator

    def report(self) -> dict[str, Any]:
        # What the generating process allows on this eval split, and what a regression on its
        # planted indicators reaches: a run's NE is read against both, its AUC and GAUC against
        # the true probabilities' (the ceilings of ranking).
        return {"source": "synthetic-ads", "rows_generated": self.rows_generated,
                "rows_dropped": 0, "rows_repaired": 0,
                **achievable_entries(self.achievable_figures()),
                "indicator_ne": self.indicator_ne()}


def synthetic_ads_factory(config: DataConfig, *, seed: int, options: SyntheticAdsOptions
                          ) -> SyntheticAdsSource:
    return SyntheticAdsSource(config, seed=seed, options=options)
