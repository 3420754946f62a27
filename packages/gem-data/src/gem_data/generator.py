"""A realistic synthetic ads log, one row per request, with a known label-generating process.

The **world** is fixed by the seed: ``num_items`` ads, each with a raw 64-bit hashed id (the
splitmix64 mix of its index and the seed: values spread over the whole int64 range, looked up
through a ``hash``-policy table as production ids are), an advertiser and a category (the
advertiser's); Zipf ad popularity; users with three interest categories and two segments.

Each **request** (row) is a user's history plus ``K`` candidate ads (``K`` truncated-Zipf,
``1 <= K <= max_candidates``). History events come in sessions of ``session_length`` events, each
session from one of the user's interests (or, 25 % of events, from global popularity); every
event carries the ad's id, advertiser and category and an action type (0 view, 1 click,
2 conversion). Candidates are drawn from the user's recent events' advertisers, from the user's
interests, or by popularity.

**The planted label** depends on the *attributes* (advertiser, category) of the history, never on
ad ids. With ``recent`` the last ``recent_window`` events of the history and *engaged* meaning
action >= 1 (clicked or converted)::

    click_logit = click_bias
        + recent_advertiser_weight * [an engaged recent event has the candidate's advertiser]
        + recent_category_weight   * [an engaged recent event has the candidate's category]
        + recent_view_weight       * [any recent event has the candidate's category]
        + history_weight           * affinity
        + 0.5 * dense[0] + 0.6 * [segment[0] % 4 == 0] + 0.3 * [context == 3]
    affinity = share of the whole history (action-weighted 1/3/6, recency-weighted with a
               time constant of 64 events) in the candidate's category
    conversion_logit = conversion_bias + 1.5 * [recent advertiser match] + 1.0 * affinity
                       + 0.8 * dense[1]
    click ~ Bernoulli(sigmoid(click_logit)); conversion = click & Bernoulli(sigmoid(conv_logit))

That is the ``ads`` kind (``planted``, its default). Each other **planted kind** needs one
thing a simple model lacks: it replaces the three ``recent_*_weight`` match terms by its own
(the ``[...]`` indicators of :mod:`gem_data.planted`, listed per kind below), keeps
``history_weight * affinity`` and the request terms, and its ``main`` term is the conversion
logit's ``1.5 * [...]``::

    multi_valued: + topic_weight * min(overlap, 2)
                  + recent_view_weight * [a recent event shares a topic with the candidate]
        overlap = distinct topics of the candidate that an engaged recent event has;
        main = [overlap >= 1]. Every ad has 1-3 distinct topics (the multi-valued event and
        candidate feature ``topics``, table ``topic``; how: :data:`gem_data.planted.TOPIC_POOL`).
    rare_action:  + recent_advertiser_weight * [an engaged event of the candidate's advertiser
                                                among the last long_window events]  (main)
                  + recent_category_weight * [a converted event of its category among the
                                              last long_window events]
                  + recent_view_weight * [any recent event has the candidate's category]
        History actions are 0.96 / 0.035 / 0.005 and histories long: ``mean_length`` 0 (its
        default) means a median of 300 here (60 in the other kinds); a value set is kept.
        Most events that fire ``main`` are older than the last 32.
    hierarchy:    + parent_weight * [an engaged recent event's category has the candidate's
                                     category's parent]  (main; the same category included)
                  + 0.5 * [an engaged recent event has the candidate's category]
        So the same category adds parent_weight + 0.5, a sibling parent_weight. Category c's
        parent is fixed by the seed (``num_parents`` families of about equal size) and is
        not a feature.
    order:        + order_weight * ([e and v, e after v] - [e and v, e before v])
        e = the user's most recent engaged event of the candidate's category, v = the most
        recent view (action 0) of the candidate's advertiser, both anywhere in the history;
        "after" is more recent. 0 when either is missing. main = [e and v, e after v].
    cross:        + cross_weight * [bit(context) + bit(category) + [dense[2] > 0] is odd]  (main)
                  + recent_category_weight * [an engaged recent event has the candidate's
                                              category]
        bit() is a hidden 0/1 per context and per category, half of each 1, fixed by the seed
        (:attr:`gem_data.planted.PlantedWorld.context_bit`). A three-way parity: no feature
        and no pair of features says anything about it, so only a model that crosses all
        three (an interaction of order three: Wukong's stacked FM, DCN's cross layers, or an
        MLP that finds it) can read it.

Both redraw some candidates so that their terms fire often
(:data:`gem_data.planted.EXPANSION_FRACTION`).

With ``drift_weight > 0`` the click logit also has a per-category term that turns with the
chunk's time (``train_start`` + index for training chunks, ``eval_time`` for the eval split,
the window's index for :meth:`AdsLogGenerator.window_chunk`): a drifting world where a model
trained on an older window goes stale (see :meth:`AdsLogGenerator.category_drift`).

**Time windows** (:meth:`AdsLogGenerator.window_chunk`, written by ``gem data synth --windows``,
:mod:`gem_data.synth_windows`): the requests of a window lie in its own span of seconds, in time
order, and their labels come from the process at the window's time. An ad may be replaced by a
new one (a fresh raw id, :meth:`AdsLogGenerator.ad_id`, with the same advertiser, category,
topics and content): the labels depend on attributes only, so only the ids change.

:meth:`AdsLogGenerator.chunk_with_probabilities` returns the true probability of every label
(``P(click)`` and ``P(conversion) = P(click) * P(conversion | click)``), and
:func:`achievable_ne` the NE those probabilities reach on the eval split: the floor a model
can approach (:func:`achievable_figures` adds their AUC and GAUC, the ceilings of ranking),
which ``gem data synth`` writes into the manifest, next to the NE of a logistic regression on
the kind's indicators (:meth:`AdsLogGenerator.chunk_with_indicators`,
:func:`gem_data.indicator_ne.indicator_regression_ne`).

Every chunk is a pure function of ``(seed, split, index)``: data sets are reproducible byte for
byte, chunks can be generated in any order, and in-memory streams resume exactly.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator, NamedTuple

import numpy as np
import torch

from gem_core.batch import JaggedBatch
from gem_core.ids import splitmix64
from gem_core.jagged import Jagged
from gem_core.schema import ContextFeature, EmbeddingTable, FeatureSchema, SequenceFeature
from gem_data.planted import (
    INDICATOR_NAMES,
    RARE_ACTION_PROBS,
    Events,
    Impressions,
    Requests,
    expand_candidates,
    jagged_topics,
    planted_indicators,
    planted_world,
)
from gem_data.synth_options import SynthOptions

NUM_ACTIONS = 3  # view, click, conversion
ACTION_PROBS = (0.8, 0.17, 0.03)
SPLIT_IDS = {"train": 1, "eval": 2}
WINDOW_STREAM = 6
"""First key of the random streams of window chunks, ``[seed, 6, window + 1, index + 1]``
(numpy pads seed lists with zeros, so no key may be a list of another key with zeros added:
the ``+ 1`` keeps them apart from ``[seed, 6]``)."""
TASKS = ("click", "conversion")
EVAL_CHUNK_ROWS = 4096
"""The eval split is generated in chunks of this many requests (the last one shorter), whatever
the batch or row-group size, so ``gem data synth``, the ``synthetic-ads`` source and
:func:`achievable_ne` all see the same eval requests for the same seed and row count."""
_NUM_SEGMENTS, _NUM_CONTEXTS = 64, 16
_AD_ID_SALT = 0x5EED_AD5


class PlantedChunk(NamedTuple):
    """A chunk with what generated its labels (:meth:`AdsLogGenerator.chunk_with_indicators`)."""

    batch: JaggedBatch
    probabilities: dict[str, np.ndarray]
    """Per task, the true probability of a positive label of each candidate (``(N,)``)."""

    indicators: np.ndarray
    """``(N, k)`` float64: the planted kind's indicators of each candidate, the columns of
    :attr:`AdsLogGenerator.indicator_names` (the main indicator first, affinity last)."""

    request_terms: np.ndarray
    """``(N, 4)`` float64: the request-level terms of the click logit of each candidate's
    request: ``dense[0]``, ``dense[1]``, ``[segment[0] % 4 == 0]``, ``[context == 3]``."""


AdIds = Callable[[np.ndarray, np.ndarray], np.ndarray]
"""``(items, times) -> raw ids``: the id each ad (index) had at each time (seconds)."""


def truncated_zipf_pmf(exponent: float, maximum: int) -> np.ndarray:
    """P(K = k) for k = 1..maximum, proportional to k ** -exponent."""
    weights = np.arange(1, maximum + 1, dtype=np.float64) ** -exponent
    return weights / weights.sum()


class AdsLogGenerator:
    """Requests of one seeded world; ``chunk(n, split=..., index=...)`` is deterministic."""

    def __init__(self, options: SynthOptions, *, seed: int) -> None:
        self.options, self.seed = options, seed
        o = options
        world = np.random.default_rng([seed, 0])
        self.advertiser_category = world.integers(0, o.num_clusters, o.num_advertisers)
        self.item_advertiser = world.integers(0, o.num_advertisers, o.num_items)
        self.item_cluster = self.advertiser_category[self.item_advertiser]
        popularity = 1.0 / np.arange(1, o.num_items + 1) ** o.zipf_exponent
        self.item_cdf = np.cumsum(world.permutation(popularity / popularity.sum()))
        order = np.argsort(self.item_cluster, kind="stable")
        self._cluster_items = order
        self._cluster_starts = np.searchsorted(self.item_cluster[order],
                                               np.arange(o.num_clusters + 1))
        order = np.argsort(self.item_advertiser, kind="stable")
        self._advertiser_items = order
        self._advertiser_starts = np.searchsorted(self.item_advertiser[order],
                                                  np.arange(o.num_advertisers + 1))
        self.user_clusters = world.integers(0, o.num_clusters, (o.num_users, 3))
        self.user_segment = world.integers(0, _NUM_SEGMENTS, (o.num_users, 2))
        dim = max(o.seq_dense_dim, 1)
        centroids = world.standard_normal((o.num_clusters, dim))
        self.item_content = (centroids[self.item_cluster] + 0.5 * world.standard_normal(
            (o.num_items, dim)))[:, :o.seq_dense_dim].astype(np.float32)
        # Raw ad ids: 64-bit hashes of (seed, index), all over the int64 range (negative too).
        self.ad_ids = self.ad_id(np.arange(o.num_items))
        self.candidates_cdf = np.cumsum(truncated_zipf_pmf(o.candidates_exponent,
                                                           o.max_candidates))
        self.schema = synthetic_ads_schema(o)
        # The drift directions come from their own stream, so the world above is unchanged.
        drift = np.random.default_rng([seed, 3])
        self.drift_u, self.drift_v = drift.standard_normal((2, o.num_clusters))
        self.planted_world = planted_world(o, seed, self.item_cluster, _NUM_CONTEXTS)
        self.indicator_names = INDICATOR_NAMES[o.planted]

    def category_drift(self, time: int) -> np.ndarray:
        """``(num_clusters,)`` click-logit offset of each category at chunk time ``time``."""
        o = self.options
        phase = 2.0 * math.pi * time / o.drift_period
        return o.drift_weight * (math.cos(phase) * self.drift_u + math.sin(phase) * self.drift_v)

    def ad_id(self, items: np.ndarray, generation: np.ndarray | int = 0) -> np.ndarray:
        """Raw id of ad ``items`` (indices) in its ``generation``: 0 is the catalogue's id
        (:attr:`ad_ids`), each later one the id of a new ad that replaced it (same attributes).
        splitmix64 is a bijection of int64 and ``index + generation * num_items`` differs for
        every pair, so no two (ad, generation) share an id."""
        salted = (np.asarray(items, dtype=np.int64)
                  + np.asarray(generation, dtype=np.int64) * self.options.num_items
                  + (self.seed * 1_000_003 + _AD_ID_SALT))
        return splitmix64(torch.from_numpy(np.ascontiguousarray(salted))).numpy()

    def probabilities_at(self, chunk: PlantedChunk, *, drawn_at: float, time: float
                         ) -> dict[str, np.ndarray]:
        """Per task, the probability of a positive label of ``chunk``'s impressions (drawn by
        the process at time ``drawn_at``) under the process at ``time``: what a model that knew
        the process of ``time`` perfectly predicts. Only the click logit's category drift
        differs; ``P(conversion | click)`` does not drift."""
        if not self.options.drift_weight or time == drawn_at:
            return dict(chunk.probabilities)
        category = chunk.batch.candidate_ids["category"].numpy()
        shift = self.category_drift(time)[category] - self.category_drift(drawn_at)[category]
        p_click = chunk.probabilities["click"]
        moved = _sigmoid(np.log(p_click) - np.log1p(-p_click) + shift)
        # P(conversion) = P(click) * P(conversion | click): keep the second factor.
        convert = np.divide(chunk.probabilities["conversion"], p_click,
                            out=np.zeros_like(p_click), where=p_click > 0)
        return {"click": moved, "conversion": moved * convert}

    # -- drawing helpers ----------------------------------------------------------------------

    def _popular_items(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return np.minimum(np.searchsorted(self.item_cdf, rng.random(size)),
                          self.options.num_items - 1)

    @staticmethod
    def _from_groups(rng: np.random.Generator, members: np.ndarray, starts: np.ndarray,
                     groups: np.ndarray) -> np.ndarray:
        """One item of each group in ``groups``, favouring the group's first (arbitrary but
        fixed) items (squared uniform); a group without items falls back to its neighbour."""
        lo = starts[groups]
        sizes = starts[groups + 1] - lo
        pick = (rng.random(groups.size) ** 2 * sizes).astype(np.int64)
        position = np.minimum(lo + np.minimum(pick, np.maximum(sizes - 1, 0)), members.size - 1)
        return members[position]

    def _lengths(self, rng: np.random.Generator, n: int) -> np.ndarray:
        o = self.options
        if o.length_distribution == "zipf":
            raw = rng.zipf(o.length_exponent, n)
        else:
            raw = np.round(rng.lognormal(np.log(o.median_length), o.length_sigma, n))
        lengths = np.minimum(raw, o.max_length).astype(np.int64)
        lengths[rng.random(n) < o.empty_fraction] = 0
        return lengths

    # -- generation ---------------------------------------------------------------------------

    def chunk(self, n: int, *, split: str, index: int) -> JaggedBatch:
        """``n`` requests of ``split`` (``train`` or ``eval``), chunk number ``index``."""
        return self.chunk_with_probabilities(n, split=split, index=index)[0]

    def chunk_with_probabilities(self, n: int, *, split: str, index: int
                                 ) -> tuple[JaggedBatch, dict[str, np.ndarray]]:
        """:meth:`chunk` and, per task, the generating process's probability of a positive
        label for each candidate (``(N,)`` float64, aligned with the batch's labels)."""
        return self.chunk_with_indicators(n, split=split, index=index)[:2]

    def chunk_with_indicators(self, n: int, *, split: str, index: int) -> PlantedChunk:
        """:meth:`chunk_with_probabilities` and the planted kind's indicators and request-level
        terms of every candidate (see :class:`PlantedChunk`)."""
        o = self.options
        if split == "train":
            index += o.train_start
        return self._generate(n, stream=(SPLIT_IDS[split], index),
                              time=index if split == "train" else o.eval_time)

    def window_chunk(self, n: int, *, window: int, index: int, start: int, stop: int,
                     ad_ids: AdIds | None = None) -> PlantedChunk:
        """Chunk ``index`` of time window ``window``: ``n`` requests in time order, at seconds
        ``start <= t < stop``, labelled by the process at time ``window`` (so ``drift_period``
        counts windows). Histories reach back before ``start`` as far as their events go.
        ``ad_ids(items, times)`` gives the raw id of each shown ad (indices) at each time
        (seconds), e.g. a new ad's id once it replaced the catalogue's; default
        :attr:`ad_ids`."""
        return self._generate(n, stream=(WINDOW_STREAM, window + 1, index + 1), time=window,
                              span=(start, max(stop, start + 1)), ad_ids=ad_ids)

    def _generate(self, n: int, *, stream: tuple[int, ...], time: float,
                  span: tuple[int, int] | None = None, ad_ids: AdIds | None = None
                  ) -> PlantedChunk:
        o = self.options
        rng = np.random.default_rng([self.seed, *stream])
        users = rng.integers(0, o.num_users, n)
        lengths = self._lengths(rng, n)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        total = int(offsets[-1])
        row = np.repeat(np.arange(n), lengths)
        from_end = offsets[1:][row] - 1 - np.arange(total)  # 0 for the most recent event

        # History: sessions from one of the user's interests (75 %), the rest by popularity.
        if o.session_length:
            session = from_end // o.session_length
            interest_of_session = rng.integers(0, 3, (n, int(session.max(initial=0)) + 1))
            interest = interest_of_session[row, session]
        else:
            interest = rng.integers(0, 3, total)
        items = self._popular_items(rng, total)
        in_interest = rng.random(total) < 0.75
        items[in_interest] = self._from_groups(
            rng, self._cluster_items, self._cluster_starts,
            self.user_clusters[users[row[in_interest]], interest[in_interest]])
        action_probs = RARE_ACTION_PROBS if o.planted == "rare_action" else ACTION_PROBS
        actions = np.searchsorted(np.cumsum(action_probs), rng.random(total)).clip(
            0, NUM_ACTIONS - 1)
        if span is None:
            request_ts = 1_700_000_000 + rng.integers(0, 30 * 86400, n)
        else:  # the requests are exchangeable, so sorted times put the chunk in time order
            request_ts = span[0] + np.sort(rng.integers(0, span[1] - span[0], n))
        # Event times: exponential gaps summed back from the request (strictly before it).
        gaps = rng.exponential(3600.0, total)
        suffix = np.cumsum(gaps[::-1])[::-1]
        after_row = np.append(suffix, 0.0)[offsets[1:][row]]
        timestamps = request_ts[row] - (suffix - after_row).astype(np.int64) - 1
        advertiser = self.item_advertiser[items]
        category = self.item_cluster[items]

        # Candidates: K per request (truncated Zipf), retargeted / in-interest / popular.
        k = np.minimum(np.searchsorted(self.candidates_cdf, rng.random(n)) + 1, o.max_candidates)
        cand_offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(k, out=cand_offsets[1:])
        m = int(cand_offsets[-1])
        owner = np.repeat(np.arange(n), k)
        candidate = self._popular_items(rng, m)
        kind = rng.random(m)
        retarget = (kind < o.retarget_fraction) & (lengths[owner] > 0)
        in_interest_c = (~retarget) & (kind < o.retarget_fraction
                                       + (1 - o.retarget_fraction) / 2)
        if in_interest_c.any():
            candidate[in_interest_c] = self._from_groups(
                rng, self._cluster_items, self._cluster_starts,
                self.user_clusters[users[owner[in_interest_c]],
                                   rng.integers(0, 3, int(in_interest_c.sum()))])
        if retarget.any():
            picks = np.flatnonzero(retarget)
            rows_r = owner[picks]
            back = (rng.random(picks.size)
                    * np.minimum(lengths[rows_r], o.recent_window)).astype(np.int64)
            source_event = offsets[rows_r + 1] - 1 - back
            candidate[picks] = self._from_groups(rng, self._advertiser_items,
                                                 self._advertiser_starts,
                                                 advertiser[source_event])
        if o.planted in ("multi_valued", "hierarchy"):  # drawn from a stream of their own
            expand_candidates(o, self.planted_world,
                              np.random.default_rng([self.seed, *stream, 7]),
                              candidate, retarget, owner, lengths, offsets, items,
                              from_groups=self._from_groups, item_cluster=self.item_cluster,
                              by_cluster=(self._cluster_items, self._cluster_starts))
        cand_advertiser = self.item_advertiser[candidate]
        cand_category = self.item_cluster[candidate]
        topics = self.planted_world.item_topics

        dense = rng.standard_normal((n, o.num_dense)).astype(np.float32)
        segment = self.user_segment[users]
        context = rng.integers(0, _NUM_CONTEXTS, n)

        # The planted label model (see the module docstring; it draws nothing from ``rng``).
        planted = planted_indicators(
            o, self.planted_world,
            Events(row=row, from_end=from_end, advertiser=advertiser, category=category,
                   action=actions, topics=None if topics is None else topics[items]),
            Impressions(owner=owner, advertiser=cand_advertiser, category=cand_category,
                        topics=None if topics is None else topics[candidate]),
            Requests(context=context, dense=dense), n)
        main, affinity = planted.columns[:, 0], planted.affinity
        request_effect = (0.5 * dense[:, 0] + np.where(segment[:, 0] % 4 == 0, 0.6, 0.0)
                          + 0.3 * (context == 3))
        click_logit = o.click_bias
        for weight, column in zip(planted.click_weights, planted.columns.T):
            click_logit = click_logit + weight * column
        click_logit = click_logit + request_effect[owner]
        if o.drift_weight:
            click_logit = click_logit + self.category_drift(time)[cand_category]
        p_click = _sigmoid(click_logit)
        p_convert = _sigmoid(o.conversion_bias + 1.5 * main + 1.0 * affinity
                             + 0.8 * dense[owner, 1])
        click = rng.random(m) < p_click
        conversion = click & (rng.random(m) < p_convert)

        bag_lengths = rng.integers(1, 3, n)  # one or two segments per user
        segment_values = segment[np.arange(2)[None, :] < bag_lengths[:, None]]
        t = torch.from_numpy
        if ad_ids is None:
            event_ad, candidate_ad = self.ad_ids[items], self.ad_ids[candidate]
        else:
            event_ad = ad_ids(items, timestamps)
            candidate_ad = ad_ids(candidate, request_ts[owner])
        event_ids = {"ad_id": t(event_ad),
                     "advertiser": t(advertiser.astype(np.int64)),
                     "category": t(category.astype(np.int64)),
                     "action": t(actions.astype(np.int64))}
        candidate_ids = {"ad_id": t(candidate_ad),
                         "advertiser": t(cand_advertiser.astype(np.int64)),
                         "category": t(cand_category.astype(np.int64))}
        if topics is not None:
            event_ids["topics"] = jagged_topics(topics[items])
            candidate_ids["topics"] = jagged_topics(topics[candidate])
        batch = JaggedBatch(
            seq_offsets=t(offsets),
            seq_timestamps=t(timestamps.astype(np.int64)),
            event_ids=event_ids,
            request_timestamps=t(request_ts.astype(np.int64)),
            candidate_offsets=t(cand_offsets),
            candidate_ids=candidate_ids,
            labels={"click": t(click.astype(np.float32)),
                    "conversion": t(conversion.astype(np.float32))},
            sparse={"user_segment": Jagged(t(segment_values.astype(np.int64)),
                                           t(np.concatenate([[0], np.cumsum(bag_lengths)]))),
                    "context": Jagged(t(context.astype(np.int64)), torch.arange(n + 1))},
            dense=t(dense),
            seq_dense=t(self.item_content[items]) if o.seq_dense_dim else None,
            candidate_dense=t(self.item_content[candidate]) if o.seq_dense_dim else None,
            user_ids=t(users.astype(np.int64)),
        )
        request_terms = np.stack([dense[:, 0], dense[:, 1], segment[:, 0] % 4 == 0,
                                  context == 3], axis=1).astype(np.float64)[owner]
        return PlantedChunk(batch, {"click": p_click, "conversion": p_click * p_convert},
                            planted.columns, request_terms)

    def eval_chunks(self, rows: int) -> Iterator[tuple[int, int]]:
        """``(index, size)`` of the eval split's chunks for ``rows`` eval requests."""
        for index, start in enumerate(range(0, rows, EVAL_CHUNK_ROWS)):
            yield index, min(EVAL_CHUNK_ROWS, rows - start)


def synthetic_ads_schema(o: SynthOptions) -> FeatureSchema:
    """The schema of the generated data with options ``o``."""
    topics = o.planted == "multi_valued"  # a multi-valued feature of events and candidates
    topic_feature = (SequenceFeature(name="topics", table="topic", multi_valued=True),)
    return FeatureSchema(
        tables=(
            EmbeddingTable(name="ad", num_embeddings=o.ad_table_size or 2 * o.num_items,
                           id_policy=o.ad_id_policy),
            EmbeddingTable(name="advertiser", num_embeddings=o.num_advertisers),
            EmbeddingTable(name="category", num_embeddings=o.num_clusters),
            EmbeddingTable(name="action", num_embeddings=NUM_ACTIONS),
            EmbeddingTable(name="user_segment", num_embeddings=_NUM_SEGMENTS),
            EmbeddingTable(name="context", num_embeddings=_NUM_CONTEXTS),
        ) + ((EmbeddingTable(name="topic", num_embeddings=o.num_topics),) if topics else ()),
        event_features=(
            SequenceFeature(name="ad_id", table="ad"),
            SequenceFeature(name="advertiser", table="advertiser"),
            SequenceFeature(name="category", table="category"),
            SequenceFeature(name="action", table="action"),
        ) + (topic_feature if topics else ()),
        candidate_features=(
            SequenceFeature(name="ad_id", table="ad"),
            SequenceFeature(name="advertiser", table="advertiser"),
            SequenceFeature(name="category", table="category"),
        ) + (topic_feature if topics else ()),
        sparse_features=(
            ContextFeature(name="user_segment", table="user_segment"),
            ContextFeature(name="context", table="context"),
        ),
        num_dense=o.num_dense,
        seq_dense_dim=o.seq_dense_dim,
        candidate_content=bool(o.seq_dense_dim),
        tasks=TASKS,
        max_seq_len=o.max_length,
        action_feature="action",  # 0 view, 1 click, 2 conversion
        view_action=0,
    )


def normalized_entropy_of_probabilities(p: np.ndarray, labels: np.ndarray) -> float:
    """NE of predicted probabilities ``p`` against ``labels`` (the formula of
    ``gem_core.metrics.normalized_entropy``: mean cross-entropy over the entropy of the observed
    base rate); NaN when the labels are all equal."""
    p = np.clip(np.asarray(p, dtype=np.float64), 1e-12, 1 - 1e-12)
    y = np.asarray(labels, dtype=np.float64)
    base = y.mean() if y.size else 0.0
    if base <= 0.0 or base >= 1.0:
        return math.nan
    cross_entropy = -np.mean(y * np.log(p) + (1 - y) * np.log1p(-p))
    return float(cross_entropy / -(base * math.log(base) + (1 - base) * math.log1p(-base)))


def achievable_ne(generator: AdsLogGenerator, eval_rows: int) -> dict[str, float]:
    """Per task, the NE of the generating process's true probabilities on the eval split of
    ``eval_rows`` requests (the chunks of :meth:`AdsLogGenerator.eval_chunks`): the best NE any
    model can expect on that split, up to sampling noise."""
    return {task: figures["ne"] for task, figures in
            achievable_figures(generator, eval_rows).items()}


def achievable_figures(generator: AdsLogGenerator, eval_rows: int) -> dict[str, dict[str, float]]:
    """Per task, the ``ne``, ``auc`` and ``gauc`` of the generating process's true probabilities
    on the eval split of ``eval_rows`` requests, GAUC grouped by each impression's user as a
    run's evaluation groups it (``gem_core.metrics.grouped_auc``). The NE is the floor of
    :func:`achievable_ne`; the rankings are the ceilings, up to sampling noise (ranking by the
    true probability maximises the expected AUC, within each user too): two models level on
    GAUC near the true probabilities' have nothing left to tell apart, two far below it do."""
    from gem_core.metrics import grouped_auc, roc_auc

    probs: dict[str, list[np.ndarray]] = {task: [] for task in TASKS}
    labels: dict[str, list[np.ndarray]] = {task: [] for task in TASKS}
    users: list[torch.Tensor] = []
    for index, size in generator.eval_chunks(eval_rows):
        batch, p = generator.chunk_with_probabilities(size, split="eval", index=index)
        for task in TASKS:
            probs[task].append(p[task])
            labels[task].append(batch.labels[task].numpy())
        users.append(batch.user_ids[batch.candidate_rows()])
    figures: dict[str, dict[str, float]] = {}
    for task in TASKS:
        if not probs[task]:
            continue
        p, y = np.concatenate(probs[task]), np.concatenate(labels[task])
        scores, targets = torch.from_numpy(p), torch.from_numpy(y)
        figures[task] = {"ne": normalized_entropy_of_probabilities(p, y),
                         "auc": roc_auc(scores, targets),
                         "gauc": grouped_auc(scores, targets, torch.cat(users))["gauc"]}
    return figures


def achievable_entries(figures: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """:func:`achievable_figures` as a report or manifest holds them: ``achievable_ne``,
    ``achievable_auc`` and ``achievable_gauc``, each per task."""
    metrics = dict.fromkeys(metric for per_task in figures.values() for metric in per_task)
    return {f"achievable_{metric}": {task: per_task[metric] for task, per_task in figures.items()}
            for metric in metrics}


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))
