"""The planted label kinds of the synthetic ads log: which history pattern raises a click.

Each kind (``SynthOptions.planted``) is a world where the click label needs one thing a simple
model lacks. This module holds what a kind adds to the world (:func:`planted_world`: ad topics,
category parents) and its **planted indicators**: per candidate, the terms of the click logit
that cross the candidate with the history (:func:`planted_indicators`). The generator adds the
request-level terms, draws the labels and returns the indicators with the batch
(:meth:`gem_data.generator.AdsLogGenerator.chunk_with_indicators`), so that
:func:`gem_data.indicator_ne.indicator_regression_ne` can fit a logistic regression on them.

The formulas of every kind are in the docstring of :mod:`gem_data.generator`.
"""

from __future__ import annotations

from typing import Callable

import attrs
import numpy as np
import torch

from gem_core.jagged import Jagged
from gem_data.synth_options import PLANTED_KINDS, SynthOptions

ACTION_WEIGHT = np.array([1.0, 3.0, 6.0])
"""Weight of a view, a click and a conversion in the affinity term."""

RARE_ACTION_PROBS = (0.96, 0.035, 0.005)
"""View, click and conversion probabilities of history events in the ``rare_action`` kind."""

MAX_TOPICS = 3
"""Most topics of one ad (``multi_valued``); every ad has at least one."""

TOPIC_POOL = 4
"""Distinct topics related to each category (``multi_valued``; fewer if ``num_topics`` is
smaller): an ad's first topic is one of its category's, each further one is too with
probability :data:`RELATED_TOPIC_SHARE` (else any topic)."""

RELATED_TOPIC_SHARE = 0.8

EXPANSION_FRACTION = 0.3
"""Share of the candidates that are not retargeted which ``multi_valued`` redraws as an ad of a
topic of a recent event, and ``hierarchy`` as an ad of a sibling category of a recent event."""

SAME_CATEGORY_BONUS = 0.5
"""``hierarchy``: click-logit bonus of an engaged recent event of the candidate's own category,
on top of the parent term (which such an event fires too)."""

NEVER = np.iinfo(np.int64).max
"""The position (events from the end) of an event that is not in the history."""


@attrs.frozen
class PlantedWorld:
    """What a kind adds to the world, fixed by the seed (drawn from streams of its own, so the
    ``ads`` world is unchanged)."""

    item_topics: np.ndarray | None = None
    """``multi_valued``: ``(num_items, MAX_TOPICS)`` distinct topics of each ad, left-aligned,
    padded with -1."""

    topic_items: np.ndarray | None = None
    """``multi_valued``: the ads of each topic, topic after topic (an ad once per topic)."""

    topic_starts: np.ndarray | None = None
    """``multi_valued``: ``(num_topics + 1,)`` offsets of each topic's ads in ``topic_items``."""

    category_parent: np.ndarray | None = None
    """``hierarchy``: ``(num_clusters,)`` parent of each category (not a feature)."""

    family_members: np.ndarray | None = None
    """``hierarchy``: the categories of each parent, parent after parent."""

    family_starts: np.ndarray | None = None
    """``hierarchy``: ``(num_parents + 1,)`` offsets of each parent's categories."""

    family_rank: np.ndarray | None = None
    """``hierarchy``: each category's position among its parent's categories."""

    context_bit: np.ndarray | None = None
    """``cross``: ``(num_contexts,)`` hidden bit (0 or 1) of each context, half of them 1."""

    category_bit: np.ndarray | None = None
    """``cross``: ``(num_clusters,)`` hidden bit of each category, half of them 1 (one more 0
    where the count is odd)."""


def planted_world(o: SynthOptions, seed: int, item_cluster: np.ndarray, num_contexts: int
                  ) -> PlantedWorld:
    """The world additions of kind ``o.planted`` for the ads' categories ``item_cluster`` and
    ``num_contexts`` request contexts."""
    if o.planted == "cross":
        rng = np.random.default_rng([seed, 8])
        return PlantedWorld(context_bit=rng.permutation(num_contexts) % 2,
                            category_bit=rng.permutation(o.num_clusters) % 2)
    if o.planted == "multi_valued":
        rng = np.random.default_rng([seed, 4])
        num_items = item_cluster.size
        pool = min(TOPIC_POOL, o.num_topics)
        pools = np.argsort(rng.random((o.num_clusters, o.num_topics)), axis=1)[:, :pool]
        counts = rng.integers(1, MAX_TOPICS + 1, num_items)
        related = pools[item_cluster[:, None], rng.integers(0, pool, (num_items, MAX_TOPICS))]
        anywhere = rng.integers(0, o.num_topics, (num_items, MAX_TOPICS))
        keep_related = rng.random((num_items, MAX_TOPICS)) < RELATED_TOPIC_SHARE
        keep_related[:, 0] = True
        topics = np.where(keep_related, related, anywhere)
        topics[np.arange(MAX_TOPICS)[None, :] >= counts[:, None]] = -1
        for j in range(1, MAX_TOPICS):  # a topic already listed is dropped
            topics[(topics[:, j:j + 1] == topics[:, :j]).any(axis=1), j] = -1
        topics = np.take_along_axis(topics, np.argsort(topics < 0, axis=1, kind="stable"), 1)
        item, slot = np.nonzero(topics >= 0)
        order = np.argsort(topics[item, slot], kind="stable")
        return PlantedWorld(item_topics=topics, topic_items=item[order],
                            topic_starts=np.searchsorted(topics[item, slot][order],
                                                         np.arange(o.num_topics + 1)))
    if o.planted == "hierarchy":
        rng = np.random.default_rng([seed, 5])
        parent = rng.permutation(o.num_clusters) % o.num_parents  # about equal families
        members = np.argsort(parent, kind="stable")
        starts = np.searchsorted(parent[members], np.arange(o.num_parents + 1))
        rank = np.empty(o.num_clusters, dtype=np.int64)
        rank[members] = np.arange(o.num_clusters) - starts[parent[members]]
        return PlantedWorld(category_parent=parent, family_members=members,
                            family_starts=starts, family_rank=rank)
    return PlantedWorld()


def jagged_topics(topics: np.ndarray) -> Jagged:
    """Padded ``(rows, MAX_TOPICS)`` topics (-1: none, as :attr:`PlantedWorld.item_topics`) as
    ids jagged over the rows: the multi-valued ``topics`` feature of events and candidates."""
    valid = topics >= 0
    offsets = np.zeros(topics.shape[0] + 1, dtype=np.int64)
    np.cumsum(valid.sum(axis=1), out=offsets[1:])
    return Jagged(torch.from_numpy(topics[valid].astype(np.int64)), torch.from_numpy(offsets))


def sibling_categories(world: PlantedWorld, rng: np.random.Generator,
                       categories: np.ndarray) -> np.ndarray:
    """A uniformly drawn other category of the same parent for each of ``categories`` (the
    category itself where its parent has no other)."""
    parent = world.category_parent[categories]
    lo = world.family_starts[parent]
    size = world.family_starts[parent + 1] - lo
    pick = (rng.random(categories.size) * np.maximum(size - 1, 1)).astype(np.int64)
    pick += pick >= world.family_rank[categories]  # skip the category itself
    return np.where(size > 1, world.family_members[lo + np.minimum(pick, size - 1)], categories)


def expand_candidates(o: SynthOptions, world: PlantedWorld, rng: np.random.Generator,
                      candidate: np.ndarray, retarget: np.ndarray, owner: np.ndarray,
                      lengths: np.ndarray, offsets: np.ndarray, items: np.ndarray, *,
                      from_groups: Callable, item_cluster: np.ndarray,
                      by_cluster: tuple[np.ndarray, np.ndarray]) -> None:
    """Redraw, in place, :data:`EXPANSION_FRACTION` of the ``candidate`` ads that are not
    ``retarget`` ones (of requests with a history) as an ad related to one of the request's last
    ``recent_window`` events: one of its topics (``multi_valued``) or a sibling category
    (``hierarchy``), so that the kind's planted term fires often. ``from_groups(rng, members,
    starts, groups)`` draws one ad of each group; ``by_cluster`` holds the members and starts
    of the categories' ads, ``item_cluster`` each ad's category."""
    picks = np.flatnonzero((rng.random(candidate.size) < EXPANSION_FRACTION) & ~retarget
                           & (lengths[owner] > 0))
    rows = owner[picks]
    back = (rng.random(picks.size) * np.minimum(lengths[rows], o.recent_window)).astype(np.int64)
    source = items[offsets[rows + 1] - 1 - back]  # the ad of the related recent event
    if o.planted == "multi_valued":
        topics = world.item_topics[source]
        slot = (rng.random(picks.size) * (topics >= 0).sum(axis=1)).astype(np.int64)
        candidate[picks] = from_groups(rng, world.topic_items, world.topic_starts,
                                       topics[np.arange(picks.size), slot])
    elif o.planted == "hierarchy":
        siblings = sibling_categories(world, rng, item_cluster[source])
        candidate[picks] = from_groups(rng, *by_cluster, siblings)


@attrs.frozen
class Events:
    """A chunk's history events, flattened request after request (oldest first)."""

    row: np.ndarray
    """The request of each event."""

    from_end: np.ndarray
    """Position from the end of its history: 0 for the most recent event."""

    advertiser: np.ndarray
    category: np.ndarray
    action: np.ndarray
    topics: np.ndarray | None = None
    """``multi_valued``: ``(events, MAX_TOPICS)``, padded with -1."""


@attrs.frozen
class Impressions:
    """A chunk's candidates, request after request."""

    owner: np.ndarray
    """The request of each candidate."""

    advertiser: np.ndarray
    category: np.ndarray
    topics: np.ndarray | None = None


@attrs.frozen
class Requests:
    """A chunk's request-level features that a kind may cross with the candidate."""

    context: np.ndarray
    """``(n,)`` context id of each request."""

    dense: np.ndarray
    """``(n, num_dense)`` dense features of each request."""


@attrs.frozen
class Indicators:
    """A kind's planted indicators of a chunk and how they enter the click logit."""

    names: tuple[str, ...]
    columns: np.ndarray
    """``(candidates, len(names))`` float64; column 0 is the kind's main indicator."""

    click_weights: tuple[float, ...]
    """Click-logit weight of each column: ``click_bias + sum_j weight_j * column_j`` (added in
    this order) plus the request-level terms."""

    @property
    def affinity(self) -> np.ndarray:
        return self.columns[:, self.names.index("affinity")]


INDICATOR_NAMES = {
    "ads": ("recent_advertiser", "recent_category", "recent_view", "affinity"),
    "multi_valued": ("topic_overlap_1", "topic_overlap_2", "recent_topic", "affinity"),
    "rare_action": ("long_advertiser", "long_converted_category", "recent_view", "affinity"),
    "hierarchy": ("recent_parent", "recent_category", "affinity"),
    "order": ("engaged_after_view", "engaged_before_view", "affinity"),
    "cross": ("cross_parity", "recent_category", "affinity"),
}
"""The indicator columns of each kind, main indicator first."""


def planted_indicators(o: SynthOptions, world: PlantedWorld, events: Events, cands: Impressions,
                       requests: Requests, n: int) -> Indicators:
    """The planted indicators of kind ``o.planted`` for ``n`` requests' ``events``, their
    candidates ``cands`` and their ``requests``' features."""
    affinity = _affinity(events, cands, n, o.num_clusters)
    kind = o.planted
    engaged = _recent(events, n, o.recent_window, events.action >= 1, False)[cands.owner]

    def recent_hit(event_values: np.ndarray, cand_values: np.ndarray) -> np.ndarray:
        """``(candidates, recent_window)``: which recent events match the candidate."""
        return _recent(events, n, o.recent_window, event_values, -1)[cands.owner] == \
            cand_values[:, None]

    if kind == "ads":
        adv_hit = recent_hit(events.advertiser, cands.advertiser)
        cat_hit = recent_hit(events.category, cands.category)
        columns = ((adv_hit & engaged).any(axis=1), (cat_hit & engaged).any(axis=1),
                   cat_hit.any(axis=1))
        weights = (o.recent_advertiser_weight, o.recent_category_weight, o.recent_view_weight)
    elif kind == "multi_valued":
        overlap, shared_any = _topic_overlap(events, cands, n, o.recent_window, engaged)
        columns = (overlap >= 1, overlap >= 2, shared_any)
        weights = (o.topic_weight, o.topic_weight, o.recent_view_weight)
    elif kind == "rare_action":
        window = events.from_end < o.long_window
        long_adv = _latest(events.row, events.advertiser, events.from_end,
                           (events.action >= 1) & window, cands.owner, cands.advertiser,
                           o.num_advertisers) != NEVER
        long_conv = _latest(events.row, events.category, events.from_end,
                            (events.action == 2) & window, cands.owner, cands.category,
                            o.num_clusters) != NEVER
        columns = (long_adv, long_conv, recent_hit(events.category, cands.category).any(axis=1))
        weights = (o.recent_advertiser_weight, o.recent_category_weight, o.recent_view_weight)
    elif kind == "hierarchy":
        parent = world.category_parent
        family_hit = recent_hit(parent[events.category], parent[cands.category])
        cat_hit = recent_hit(events.category, cands.category)
        columns = ((family_hit & engaged).any(axis=1), (cat_hit & engaged).any(axis=1))
        weights = (o.parent_weight, SAME_CATEGORY_BONUS)
    elif kind == "order":
        engaged_at = _latest(events.row, events.category, events.from_end, events.action >= 1,
                             cands.owner, cands.category, o.num_clusters)
        viewed_at = _latest(events.row, events.advertiser, events.from_end, events.action == 0,
                            cands.owner, cands.advertiser, o.num_advertisers)
        both = (engaged_at != NEVER) & (viewed_at != NEVER)
        columns = (both & (engaged_at < viewed_at), both & (engaged_at > viewed_at))
        weights = (o.order_weight, -o.order_weight)
    elif kind == "cross":
        cat_hit = recent_hit(events.category, cands.category)
        columns = (cross_parity(world, requests, cands), (cat_hit & engaged).any(axis=1))
        weights = (o.cross_weight, o.recent_category_weight)
    else:
        raise ValueError(f"unknown planted kind {kind!r}; known: {', '.join(PLANTED_KINDS)}")
    matrix = np.empty((cands.owner.size, len(columns) + 1), dtype=np.float64)
    for j, column in enumerate(columns):
        matrix[:, j] = column
    matrix[:, -1] = affinity
    return Indicators(names=INDICATOR_NAMES[kind], columns=matrix,
                      click_weights=(*weights, o.history_weight))


def cross_parity(world: PlantedWorld, requests: Requests, cands: Impressions) -> np.ndarray:
    """``cross``: per candidate, whether an odd number of its request's context bit, its
    category's bit and ``[dense[2] > 0]`` are 1. Each of the three (and each pair) is
    independent of the parity, so only a model that crosses all three can read it."""
    bits = (world.context_bit[requests.context[cands.owner]]
            + world.category_bit[cands.category]
            + (requests.dense[cands.owner, 2] > 0))
    return bits % 2 == 1


def _affinity(events: Events, cands: Impressions, n: int, num_clusters: int) -> np.ndarray:
    """Share of each candidate's request history (action-weighted 1/3/6, recency-weighted with
    a time constant of 64 events) in the candidate's category."""
    weight = np.exp(-events.from_end / 64.0) * ACTION_WEIGHT[events.action]
    by_cluster = np.bincount(events.row * num_clusters + events.category, weight,
                             minlength=n * num_clusters).reshape(n, num_clusters)
    return (by_cluster[cands.owner, cands.category]
            / np.maximum(np.bincount(events.row, weight, minlength=n), 1e-9)[cands.owner])


def _recent(events: Events, n: int, w: int, values: np.ndarray, fill) -> np.ndarray:
    """``(n, w)``: ``values`` of each request's last ``w`` events, the most recent first;
    ``fill`` where the history is shorter."""
    out = np.full((n, w), fill, dtype=values.dtype)
    recent = events.from_end < w
    out[events.row[recent], events.from_end[recent]] = values[recent]
    return out


def _topic_overlap(events: Events, cands: Impressions, n: int, w: int, engaged: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Per candidate: how many of its (distinct) topics an engaged event among the request's
    last ``w`` events has (``engaged``: ``(candidates, w)``, which of them are), and whether
    any of the last ``w`` events shares one of its topics."""
    recent_topics = np.full((n, w, MAX_TOPICS), -1, dtype=np.int64)
    recent = events.from_end < w
    recent_topics[events.row[recent], events.from_end[recent]] = events.topics[recent]
    # (candidates, candidate topic, recent event, event topic)
    same = ((cands.topics[:, :, None, None] == recent_topics[cands.owner][:, None, :, :])
            & (cands.topics >= 0)[:, :, None, None])
    engaged_topic = (same & engaged[:, None, :, None]).any(axis=(2, 3))
    return engaged_topic.sum(axis=1), same.any(axis=(1, 2, 3))


def _latest(row: np.ndarray, values: np.ndarray, from_end: np.ndarray, mask: np.ndarray,
            owner: np.ndarray, query: np.ndarray, size: int) -> np.ndarray:
    """Per candidate (request ``owner``, attribute ``query``), the position from the end of the
    most recent event of its request among ``mask`` whose attribute ``values`` (ids below
    ``size``) equals the candidate's; :data:`NEVER` where there is none."""
    span = int(from_end.max(initial=0)) + 1
    packed = np.sort((row[mask] * size + values[mask]) * span + from_end[mask])
    keys, positions = packed // span, packed % span
    first = np.ones(keys.size, dtype=bool)
    first[1:] = keys[1:] != keys[:-1]  # the smallest position of each key comes first
    keys, positions = keys[first], positions[first]
    wanted = owner * size + query
    if not keys.size:
        return np.full(wanted.size, NEVER, dtype=np.int64)
    at = np.minimum(np.searchsorted(keys, wanted), keys.size - 1)
    return np.where(keys[at] == wanted, positions[at], NEVER)
