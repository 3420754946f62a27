"""``synthetic``: a small generated ads log whose labels depend on candidate x history.

Items belong to interest clusters and have Zipf popularity; every user prefers a few clusters, and
their history (heavy-tailed length, some empty) is drawn mostly from those. The click probability
of an impression grows with the share of the user's recent history in the candidate's cluster
(weighted by action: clicks and conversions count more), plus dense and sparse effects; conversion
is drawn among clicks. So a model that attends from the candidate to the history can beat one that
ignores it. Every batch is a pure function of ``(seed, split, index)``: resumable and repeatable.

gem-data provides the full generator and on-disk formats; this one exists so that gem-core alone
trains end to end.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import attrs
import numpy as np
import torch

from gem_core.batch import JaggedBatch
from gem_core.config import DataConfig
from gem_core.config.validators import at_least, between, greater_than
from gem_core.data.api import Balancer, DataSource, IndexedStream
from gem_core.jagged import Jagged
from gem_core.schema import ContextFeature, EmbeddingTable, FeatureSchema, SequenceFeature

NUM_ACTIONS = 3  # view, click, conversion
_TRAIN, _EVAL = 1, 2
EVAL_CHUNK = 1024
"""Eval rows are generated in chunks of this many, whatever the eval batch size, so the eval
set is the same rows for every ``eval_batch_size`` (and for a data set exported from it)."""


@attrs.frozen(kw_only=True)
class SyntheticOptions:
    """``[data.options]`` of the ``synthetic`` source."""

    num_items: int = attrs.field(default=2000, validator=greater_than(10))
    """Item id space (history items and candidates)."""

    num_users: int = attrs.field(default=5000, validator=greater_than(0))
    """Distinct users whose interests are fixed by the seed."""

    num_clusters: int = attrs.field(default=20, validator=greater_than(1))
    """Interest clusters items belong to."""

    zipf_exponent: float = attrs.field(default=1.1, validator=greater_than(0))
    """Item popularity ~ rank^-exponent."""

    mean_length: float = attrs.field(default=40.0, validator=greater_than(0))
    """Median history length (lognormal) before truncation to ``data.max_seq_len``."""

    session_length: int = attrs.field(default=16, validator=at_least(0))
    """In-interest history events come in sessions of this many events, each session from one of
    the user's interests, so the recent events show the user's current intent (which the planted
    label rewards) and differ from the history as a whole. 0: every event picks an interest at
    random (no drift: the mean of the history then carries almost all of the signal)."""

    empty_fraction: float = attrs.field(default=0.05, validator=between(0.0, 1.0))
    """Share of impressions with no history at all."""

    click_bias: float = attrs.field(default=-4.6, validator=between(-20.0, 20.0))
    """Intercept of the click logit (sets the base rate, about 3-4 % by default)."""

    history_weight: float = attrs.field(default=5.0, validator=at_least(0))
    """Effect of candidate-cluster affinity of the history on the click logit."""

    retarget_fraction: float = attrs.field(default=0.2, validator=between(0.0, 1.0))
    """Share of candidates that are an item of the user's own recent history (retargeting), drawn
    from the last ``session_length`` events (the last 16 when sessions are off)."""

    repeat_weight: float = attrs.field(default=1.5, validator=at_least(0))
    """Click-logit bonus when the candidate item itself is among the user's last
    ``session_length`` events: an item-level, candidate-specific signal that a fixed-size
    summary of the history cannot hold for every item, but attention from the candidate finds."""

    conversion_bias: float = attrs.field(default=-1.8, validator=between(-20.0, 20.0))
    """Intercept of the conversion-given-click logit."""

    candidates_per_request: int = attrs.field(default=1, validator=greater_than(0))
    """Candidates (impressions) per request, each with its own labels; ``train.batch_size``
    counts requests."""

    content_dim: int = attrs.field(default=8, validator=at_least(0))
    """Width of each item's dense content vector (its cluster's centroid plus noise), carried
    by every history event (``seq_dense``) and by the candidate (``candidate_dense``); 0 leaves
    it out."""


class SyntheticSource(DataSource):
    """The ``synthetic`` data source. Build with ``plugins.data_source(config, seed=...)``
    (:meth:`gem_core.plugins.GemPlugins.data_source`), which structures ``[data.options]``."""

    def __init__(self, config: DataConfig, *, seed: int, options: SyntheticOptions) -> None:
        self.config = config
        self.options = options
        self.seed = seed
        o = self.options
        world = np.random.default_rng([seed, 0])
        self.item_cluster = world.integers(0, o.num_clusters, o.num_items)
        popularity = 1.0 / np.arange(1, o.num_items + 1) ** o.zipf_exponent
        self.item_popularity = world.permutation(popularity / popularity.sum())
        # Per cluster, its items and their popularity (for drawing in-interest events).
        order = np.argsort(self.item_cluster, kind="stable")
        self._cluster_items = order
        self._cluster_starts = np.searchsorted(self.item_cluster[order],
                                               np.arange(o.num_clusters + 1))
        self.user_clusters = world.integers(0, o.num_clusters, (o.num_users, 3))
        self.user_segment = world.integers(0, 64, (o.num_users, 2))
        self.advertiser = world.integers(0, 100, o.num_items)
        centroids = world.standard_normal((o.num_clusters, max(o.content_dim, 1)))
        self.item_content = (centroids[self.item_cluster] + 0.5 * world.standard_normal(
            (o.num_items, max(o.content_dim, 1))))[:, :o.content_dim].astype(np.float32)
        self.schema = FeatureSchema(
            tables=(
                EmbeddingTable(name="item", num_embeddings=o.num_items),
                EmbeddingTable(name="action", num_embeddings=NUM_ACTIONS),
                EmbeddingTable(name="advertiser", num_embeddings=100),
                EmbeddingTable(name="category", num_embeddings=o.num_clusters),
                EmbeddingTable(name="user_segment", num_embeddings=64),
                EmbeddingTable(name="context", num_embeddings=16),
            ),
            event_features=(
                SequenceFeature(name="item", table="item"),
                SequenceFeature(name="action", table="action"),
            ),
            sparse_features=(
                ContextFeature(name="user_segment", table="user_segment"),
                ContextFeature(name="context", table="context"),
            ),
            candidate_features=(
                SequenceFeature(name="item", table="item"),
                SequenceFeature(name="advertiser", table="advertiser"),
                SequenceFeature(name="category", table="category"),
            ),
            num_dense=4,
            seq_dense_dim=o.content_dim,
            candidate_content=bool(o.content_dim),
            tasks=("click", "conversion"),
            max_seq_len=config.max_seq_len,
            action_feature="action",  # 0 view, 1 click, 2 conversion
            view_action=0,
        )

    # -- the contract -------------------------------------------------------------------------

    def train_stream(
        self, *, batch_size: int, rank: int, world_size: int, balancer: Balancer,
        cost_fn: Callable[[JaggedBatch], Sequence[float]],
    ) -> IndexedStream:
        return IndexedStream(
            lambda index: self.generate(batch_size, split=_TRAIN, index=index),
            rank=rank, world_size=world_size, balancer=balancer, cost_fn=cost_fn)

    def fingerprint(self) -> dict[str, str]:
        """Generated data is a function of ``[data]`` and the seed: nothing more to record."""
        return {}

    def eval_batches(self, *, batch_size: int) -> Iterator[JaggedBatch]:
        rows = self.config.generated_eval_rows
        for index, chunk_start in enumerate(range(0, rows, EVAL_CHUNK)):
            size = min(EVAL_CHUNK, rows - chunk_start)
            chunk = self.generate(size, split=_EVAL, index=index)
            if batch_size >= size:
                yield chunk
                continue
            for start in range(0, size, batch_size):
                yield chunk.select(torch.arange(start, min(start + batch_size, size)))

    # -- generation ---------------------------------------------------------------------------

    def generate(self, n: int, *, split: int, index: int) -> JaggedBatch:
        o = self.options
        rng = np.random.default_rng([self.seed, split, index])
        users = rng.integers(0, o.num_users, n)
        lengths = np.minimum(
            np.round(rng.lognormal(np.log(o.mean_length), 1.0, n)).astype(np.int64),
            self.config.max_seq_len,
        )
        lengths[rng.random(n) < o.empty_fraction] = 0
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        total = int(offsets[-1])
        row = np.repeat(np.arange(n), lengths)

        # History events: 75 % from one of the user's clusters, the rest from global popularity.
        in_interest = rng.random(total) < 0.75
        if o.session_length:
            session = (_position_from_end(offsets) // o.session_length).astype(np.int64)
            interest_of_session = rng.integers(0, 3, (n, int(session.max(initial=0)) + 1))
            interest = interest_of_session[row, session]
        else:
            interest = rng.integers(0, 3, total)
        chosen_cluster = self.user_clusters[users[row], interest]
        items = rng.choice(o.num_items, size=total, p=self.item_popularity)
        items[in_interest] = self._draw_from_clusters(rng, chosen_cluster[in_interest])
        actions = rng.choice(NUM_ACTIONS, size=total, p=[0.8, 0.17, 0.03])

        request_ts = 1_700_000_000 + rng.integers(0, 30 * 86400, n)
        # Gaps back in time, oldest first within a row: cumulative sums of exponential gaps.
        gaps = rng.exponential(3600.0, total)
        age_from_end = _reverse_cumsum_per_row(gaps, offsets)
        timestamps = request_ts[row] - age_from_end.astype(np.int64)

        # Candidates, K per request: half from the user's interests, half by popularity.
        k = o.candidates_per_request
        owner = np.repeat(np.arange(n), k)
        m = n * k
        candidate = rng.choice(o.num_items, size=m, p=self.item_popularity)
        from_interest = rng.random(m) < 0.5
        candidate[from_interest] = self._draw_from_clusters(
            rng, self.user_clusters[users[owner[from_interest]],
                                    rng.integers(0, 3, int(from_interest.sum()))]
        )
        recent_window = o.session_length or 16
        position = _position_from_end(offsets)
        recent = position < recent_window
        retarget = (rng.random(m) < o.retarget_fraction) & (lengths[owner] > 0)
        if retarget.any():
            # One of the request's recent events, uniformly: the j-th from the end, j < window.
            picks = np.flatnonzero(retarget)
            rows_r = owner[picks]
            pick = (rng.random(picks.size) * np.minimum(lengths[rows_r], recent_window)).astype(
                np.int64)
            candidate[picks] = items[offsets[rows_r + 1] - 1 - pick]
        candidate_cluster = self.item_cluster[candidate]
        recent_keys = row[recent].astype(np.int64) * o.num_items + items[recent]
        seen_recently = np.isin(owner.astype(np.int64) * o.num_items + candidate, recent_keys)

        # Planted label model: affinity of the recent history to the candidate's cluster.
        recency = np.exp(-_position_from_end(offsets) / 32.0)
        weight = recency * np.array([1.0, 3.0, 6.0])[actions]
        by_cluster = np.zeros((n, o.num_clusters))
        np.add.at(by_cluster, (row, self.item_cluster[items]), weight)
        affinity = (by_cluster[owner, candidate_cluster]
                    / np.maximum(_row_sums(weight, row, n), 1e-9)[owner])
        dense = rng.standard_normal((n, 4)).astype(np.float32)
        segment = self.user_segment[users]
        segment_effect = np.where(segment[:, 0] % 4 == 0, 0.6, 0.0)
        context = rng.integers(0, 16, n)
        click_logit = (o.click_bias + o.history_weight * affinity + 0.5 * dense[owner, 0]
                       + o.repeat_weight * seen_recently
                       + (segment_effect + 0.3 * (context == 3))[owner])
        click = rng.random(m) < _sigmoid(click_logit)
        conversion_logit = o.conversion_bias + 2.0 * affinity + 0.8 * dense[owner, 1]
        conversion = click & (rng.random(m) < _sigmoid(conversion_logit))

        segment_lengths = rng.integers(1, 3, n)
        segment_ids = np.where(np.arange(2)[None, :] < segment_lengths[:, None], segment, -1)
        segment_values = segment_ids[segment_ids >= 0]
        t = torch.from_numpy
        return JaggedBatch(
            seq_offsets=t(offsets),
            seq_timestamps=t(timestamps),
            event_ids={"item": t(items.astype(np.int64)),
                       "action": t(actions.astype(np.int64))},
            request_timestamps=t(request_ts.astype(np.int64)),
            candidate_offsets=torch.arange(n + 1, dtype=torch.int64) * k,
            candidate_ids={
                "item": t(candidate.astype(np.int64)),
                "advertiser": t(self.advertiser[candidate].astype(np.int64)),
                "category": t(candidate_cluster.astype(np.int64)),
            },
            labels={
                "click": t(click.astype(np.float32)),
                "conversion": t(conversion.astype(np.float32)),
            },
            sparse={
                "user_segment": Jagged(t(segment_values.astype(np.int64)),
                                       t(np.concatenate([[0], np.cumsum(segment_lengths)]))),
                "context": Jagged(t(context.astype(np.int64)), torch.arange(n + 1)),
            },
            dense=t(dense),
            seq_dense=t(self.item_content[items]) if o.content_dim else None,
            candidate_dense=t(self.item_content[candidate]) if o.content_dim else None,
            user_ids=t(users.astype(np.int64)),
        )

    def _draw_from_clusters(self, rng: np.random.Generator, clusters: np.ndarray) -> np.ndarray:
        starts = self._cluster_starts[clusters]
        sizes = self._cluster_starts[clusters + 1] - starts
        # Within a cluster, favour its first (arbitrary but fixed) items: squared uniform.
        pick = (rng.random(clusters.size) ** 2 * sizes).astype(np.int64)
        return self._cluster_items[starts + np.minimum(pick, np.maximum(sizes - 1, 0))]


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _row_sums(values: np.ndarray, row: np.ndarray, n: int) -> np.ndarray:
    return np.bincount(row, weights=values, minlength=n)


def _position_from_end(offsets: np.ndarray) -> np.ndarray:
    lengths = np.diff(offsets)
    row = np.repeat(np.arange(lengths.size), lengths)
    position = np.arange(int(offsets[-1])) - offsets[:-1][row]
    return (lengths[row] - 1 - position).astype(np.float64)


def _reverse_cumsum_per_row(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """For each element, the sum of itself and the later elements of its row."""
    if values.size == 0:
        return values
    total = np.cumsum(values[::-1])[::-1]
    lengths = np.diff(offsets)
    row = np.repeat(np.arange(lengths.size), lengths)
    end = offsets[1:][row]
    after_row = np.where(end < values.size, np.append(total, 0.0)[end], 0.0)
    return total - after_row
