"""A realistic synthetic ads log: Zipf items, heavy-tailed histories, labels planted on candidate x
history interaction.

The world (item clusters and popularity, users' interests and segments, advertisers) is fixed by
the seed. Each chunk of impressions is a pure function of ``(seed, split, chunk)``, so a data set
is reproducible byte for byte and chunks could be generated in any order. The click logit grows
with the share of the user's recent history (weighted by action: clicks and conversions count more)
in the candidate's interest cluster, so a target-aware model can learn more than one that ignores
the history; dense and sparse features add smaller effects. Conversions are drawn among clicks.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from gem_core.batch import JaggedBatch
from gem_core.config.validators import at_least, between, choice, greater_than
from gem_core.jagged import Jagged
from gem_core.schema import FeatureSchema, SparseFeature

NUM_ACTIONS = 3  # view, click, conversion
ACTION_PROBS = (0.8, 0.17, 0.03)
ACTION_WEIGHT = np.array([1.0, 3.0, 6.0])
SPLIT_IDS = {"train": 1, "eval": 2}


@attrs.frozen(kw_only=True)
class SynthOptions:
    """Knobs of the generated world and its impressions (``gem data synth --set key=value``)."""

    num_items: int = attrs.field(default=50_000, validator=greater_than(10))
    """Item id space of history events and candidates."""

    num_users: int = attrs.field(default=100_000, validator=greater_than(0))
    """Distinct users, each with fixed interests and segments."""

    num_clusters: int = attrs.field(default=50, validator=greater_than(1))
    """Interest clusters (also the candidate ``category`` feature)."""

    num_advertisers: int = attrs.field(default=1000, validator=greater_than(0))
    """Advertiser id space (a candidate feature)."""

    zipf_exponent: float = attrs.field(default=1.1, validator=greater_than(0))
    """Item popularity is proportional to rank ** -zipf_exponent."""

    length_distribution: str = attrs.field(default="lognormal", validator=choice("lognormal", "zipf"))
    """History length law: lognormal around ``mean_length``, or Zipf with ``length_exponent``."""

    mean_length: float = attrs.field(default=60.0, validator=greater_than(0))
    """Median history length of the lognormal law."""

    length_sigma: float = attrs.field(default=1.2, validator=greater_than(0))
    """Log-space spread of the lognormal law (1.2 gives a heavy tail)."""

    length_exponent: float = attrs.field(default=1.2, validator=greater_than(1))
    """Exponent of the Zipf length law (P(len = k) ~ k ** -exponent)."""

    max_length: int = attrs.field(default=1024, validator=greater_than(0))
    """Longest history written; longer draws keep their most recent events."""

    empty_fraction: float = attrs.field(default=0.05, validator=between(0.0, 1.0))
    """Share of impressions whose user has no history at all."""

    num_dense: int = attrs.field(default=4, validator=at_least(2))
    """Dense float features per impression (the first two carry label signal)."""

    seq_dense_dim: int = attrs.field(default=0, validator=at_least(0))
    """Width of a dense content vector per history event (0: none)."""

    click_bias: float = attrs.field(default=-4.6, validator=between(-20.0, 20.0))
    """Click logit intercept; the default gives a base rate of about 3 %."""

    history_weight: float = attrs.field(default=5.0, validator=at_least(0))
    """Effect of the history's affinity to the candidate's cluster on the click logit."""

    conversion_bias: float = attrs.field(default=-1.8, validator=between(-20.0, 20.0))
    """Conversion-given-click logit intercept (about 20-30 % of clicks convert)."""


class AdsLogGenerator:
    """Impressions of one seeded world; ``chunk(n, split=..., index=...)`` is deterministic."""

    def __init__(self, options: SynthOptions, *, seed: int) -> None:
        self.options, self.seed = options, seed
        o = options
        world = np.random.default_rng([seed, 0])
        self.item_cluster = world.integers(0, o.num_clusters, o.num_items)
        popularity = 1.0 / np.arange(1, o.num_items + 1) ** o.zipf_exponent
        self.item_cdf = np.cumsum(world.permutation(popularity / popularity.sum()))
        order = np.argsort(self.item_cluster, kind="stable")
        self._cluster_items = order
        self._cluster_starts = np.searchsorted(self.item_cluster[order],
                                               np.arange(o.num_clusters + 1))
        self.user_clusters = world.integers(0, o.num_clusters, (o.num_users, 3))
        self.user_segment = world.integers(0, 64, (o.num_users, 2))
        self.advertiser = world.integers(0, o.num_advertisers, o.num_items)
        self.schema = FeatureSchema(
            num_items=o.num_items, num_actions=NUM_ACTIONS,
            sparse_features=(SparseFeature(name="user_segment", num_embeddings=64),
                             SparseFeature(name="context", num_embeddings=16)),
            candidate_features=(SparseFeature(name="advertiser", num_embeddings=o.num_advertisers),
                                SparseFeature(name="category", num_embeddings=o.num_clusters)),
            num_dense=o.num_dense, seq_dense_dim=o.seq_dense_dim,
            tasks=("click", "conversion"), max_seq_len=o.max_length,
        )

    def _popular_items(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return np.minimum(np.searchsorted(self.item_cdf, rng.random(size)), self.options.num_items - 1)

    def _from_clusters(self, rng: np.random.Generator, clusters: np.ndarray) -> np.ndarray:
        starts = self._cluster_starts[clusters]
        sizes = self._cluster_starts[clusters + 1] - starts
        # Within a cluster favour its first (arbitrary but fixed) items: squared uniform.
        pick = (rng.random(clusters.size) ** 2 * sizes).astype(np.int64)
        return self._cluster_items[starts + np.minimum(pick, np.maximum(sizes - 1, 0))]

    def _lengths(self, rng: np.random.Generator, n: int) -> np.ndarray:
        o = self.options
        if o.length_distribution == "zipf":
            raw = rng.zipf(o.length_exponent, n)
        else:
            raw = np.round(rng.lognormal(np.log(o.mean_length), o.length_sigma, n))
        lengths = np.minimum(raw, o.max_length).astype(np.int64)
        lengths[rng.random(n) < o.empty_fraction] = 0
        return lengths

    def chunk(self, n: int, *, split: str, index: int) -> JaggedBatch:
        o = self.options
        rng = np.random.default_rng([self.seed, SPLIT_IDS[split], index])
        users = rng.integers(0, o.num_users, n)
        lengths = self._lengths(rng, n)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        total = int(offsets[-1])
        row = np.repeat(np.arange(n), lengths)

        # History: 75 % of events from one of the user's clusters, the rest by global popularity.
        items = self._popular_items(rng, total)
        in_interest = rng.random(total) < 0.75
        clusters = self.user_clusters[users[row[in_interest]], rng.integers(0, 3, int(in_interest.sum()))]
        items[in_interest] = self._from_clusters(rng, clusters)
        actions = np.searchsorted(np.cumsum(ACTION_PROBS), rng.random(total)).clip(0, NUM_ACTIONS - 1)
        request_ts = 1_700_000_000 + rng.integers(0, 30 * 86400, n)
        position_from_end = (offsets[1:][row] - 1 - np.arange(total)).astype(np.float64)
        # Event ages: exponential gaps summed back from the request, so timestamps rise in a row.
        gaps = rng.exponential(3600.0, total)
        suffix = np.cumsum(gaps[::-1])[::-1]
        after_row = np.append(suffix, 0.0)[offsets[1:][row]]
        timestamps = request_ts[row] - (suffix - after_row).astype(np.int64) - 1

        candidate = self._popular_items(rng, n)
        from_interest = rng.random(n) < 0.5
        candidate[from_interest] = self._from_clusters(
            rng, self.user_clusters[users[from_interest], rng.integers(0, 3, int(from_interest.sum()))])
        category = self.item_cluster[candidate]

        # Planted label model: recency- and action-weighted affinity of history to candidate.
        weight = np.exp(-position_from_end / 32.0) * ACTION_WEIGHT[actions]
        match = (self.item_cluster[items] == category[row]) * weight
        affinity = (np.bincount(row, match, minlength=n)
                    / np.maximum(np.bincount(row, weight, minlength=n), 1e-9))
        dense = rng.standard_normal((n, o.num_dense)).astype(np.float32)
        segment = self.user_segment[users]
        context = rng.integers(0, 16, n)
        click_logit = (o.click_bias + o.history_weight * affinity + 0.5 * dense[:, 0]
                       + np.where(segment[:, 0] % 4 == 0, 0.6, 0.0) + 0.3 * (context == 3))
        click = rng.random(n) < _sigmoid(click_logit)
        conversion = click & (rng.random(n) < _sigmoid(o.conversion_bias + 2.0 * affinity
                                                       + 0.8 * dense[:, 1]))

        bag_lengths = rng.integers(1, 3, n)  # one or two segments per user
        segment_values = segment[np.arange(2)[None, :] < bag_lengths[:, None]]
        seq_dense = None
        if o.seq_dense_dim:
            seq_dense = torch.from_numpy(rng.standard_normal((total, o.seq_dense_dim),
                                                             dtype=np.float32))
        t = torch.from_numpy
        return JaggedBatch(
            seq_offsets=t(offsets), seq_item_ids=t(items.astype(np.int64)),
            seq_action_ids=t(actions.astype(np.int64)), seq_timestamps=t(timestamps),
            request_timestamps=t(request_ts.astype(np.int64)),
            candidate_item_ids=t(candidate.astype(np.int64)),
            labels={"click": t(click.astype(np.float32)),
                    "conversion": t(conversion.astype(np.float32))},
            sparse={"user_segment": Jagged(t(segment_values.astype(np.int64)),
                                           t(np.concatenate([[0], np.cumsum(bag_lengths)]))),
                    "context": Jagged(t(context.astype(np.int64)), torch.arange(n + 1))},
            candidate_sparse={"advertiser": t(self.advertiser[candidate].astype(np.int64)),
                              "category": t(category.astype(np.int64))},
            dense=t(dense), seq_dense=seq_dense,
        )


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))
