"""Target match: what the user did with events that share an attribute with the candidate.

For every attribute a candidate shares with the history events (a candidate feature and an
event feature that index one declared table: ad id, advertiser, category, genres, ...), the
candidate looks at the most recent ``window`` events of its request and sums a learned
projection of the events that share an id with it, each weighted by how much they share: 1 for
equal single-valued ids; where either side is multi-valued (a movie's genres, an ad's topics),
the number of distinct candidate ids among the event's ids (``overlap = "count"``) or 1 if there
is any (``"any"``). An event token carries its action, age and position, so the sum says how
often, how recently and how the user engaged with that advertiser or category.

Refinements, each optional:

- an **action window**: a second, longer window (by count) in which only engaged events (an
  action other than the "view" action) are matched, through a value projection of its own, so
  a purchase 200 page views ago is found and told apart from a recent match of any action;
  optionally only its most recent ``engaged_limit`` engaged events, so the window is counted
  in engaged events ("among the last 10 cart/fav/buy events") rather than in all events; or,
  learned rather than set, each engaged match carries its **engaged rank** (1 for the latest
  engaged event; ranks 1-16 a bucket each, then one per doubling): a learned vector added to
  its token (``vector``), so the sum of matches can tell a match among the last few engaged
  events from an older one, or a learned factor on its match weight (``gate``), a soft limit;
- an **age limit**: only events younger than ``max_age_s`` seconds at the request are matched,
  in both windows;
- the **latest match** (``latest``): per shared attribute, and per kind of event (views and
  engaged events apart where an action feature is named, all events together otherwise), how
  far back the most recent matching event is, as a flag and ``log(1 + position) /
  log(1 + span)`` (position 0: the request's last event), through a small MLP into a second
  token of its own (added to the sums, it was scaled with them: a sum over many events is
  large, and ``match_token_scale`` shrinks the whole token by its size).
  A sum of matches says how often and roughly how recently; it cannot say which of two kinds
  of match came last ("viewed this advertiser after buying in this category"), which the
  positions put side by side. Positions, not ages: the order of events is always there, and
  it is what "after" means; ``max_age_s`` still limits which events count. It reads the
  windows' events, or a window of its own (``latest_window``: the whole history, say, while
  the sums keep the last 32).

Soft (dot-product) target attention can learn the same thing, but only after learning to make
``q.k`` of equal ids stand out among thousands of id embeddings; on data where the label turns
on "a clicked event among the last few has the candidate's advertiser" it was still far from
the achievable NE after thousands of steps. Exact matches of raw ids (before any hashing, so no
collision) need no learning to be found; what the match means is learned. Industrial rankers
feed the same signal as hand-made counting features ("ads of this advertiser clicked in the
last day"); here it is derived from the declared schema, for every shared table.

How it is computed: ids are compared exactly as int64. A multi-valued feature's ids are padded
to its widest row in the batch (with a mask), so the overlap of every candidate with every event
of its window is one broadcast comparison of ``candidates x window x candidate ids x event
ids``, a few values each. The event vectors are projected once per request window (not per
candidate), and each request's candidates take their weighted sums from them in one batched
matmul over the candidates padded to the widest request.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
from torch import Tensor, nn

from gem_core.batch import Ids
from gem_core.config import ModelConfig
from gem_core.config.model_schema import ENGAGED_RANKS
from gem_core.errors import GemConfigError
from gem_core.flops import linear_layer_flops
from gem_core.jagged import Jagged, max_length, offsets_from_lengths
from gem_core.model.actions import latest_by_action
from gem_core.schema import FeatureSchema

#: How a multi-valued attribute weighs an event's match (``model.target_match_overlap``).
OVERLAPS = ("count", "any")


def shared_attributes(schema: FeatureSchema) -> list[tuple[str, str]]:
    """``(candidate feature, event feature)`` pairs that index one table (single- or
    multi-valued, either side)."""
    return [(candidate.name, event.name) for candidate in schema.candidate_features
            for event in schema.event_features if candidate.table == event.table]


def recent_event_index(offsets: Tensor, owner: Tensor, window: int) -> tuple[Tensor, Tensor]:
    """For each candidate (``owner``: its request), the positions of its request's last
    ``window`` events, most recent first: ``(N, window)`` indices and a validity mask (a
    shorter history leaves slots empty)."""
    ends = offsets[1:][owner]
    lengths = (offsets[1:] - offsets[:-1])[owner]
    back = torch.arange(window, device=offsets.device)
    valid = back.unsqueeze(0) < lengths.unsqueeze(1)
    index = (ends.unsqueeze(1) - 1 - back.unsqueeze(0)).clamp(min=0)
    return index, valid


def padded_ids(ids: Ids) -> tuple[Tensor, Tensor | None]:
    """A feature's ids as ``(rows, width)`` int64 and which slots hold one (None: all of them;
    a single-valued feature is width 1). A multi-valued feature is padded to its widest row."""
    if not isinstance(ids, Jagged):
        return ids.unsqueeze(1), None
    lengths = ids.lengths()
    rows, total = lengths.numel(), ids.values.shape[0]
    device = ids.values.device
    width = max_length(lengths)
    row = torch.repeat_interleave(torch.arange(rows, device=device), lengths, output_size=total)
    slot = torch.arange(total, device=device) - ids.offsets[:-1][row]
    values = ids.values.new_zeros(rows, width).index_put_((row, slot), ids.values)
    return values, torch.arange(width, device=device) < lengths.unsqueeze(1)


def first_occurrences(values: Tensor, mask: Tensor) -> Tensor:
    """``(rows, width)``: the slots of ``padded_ids`` that hold an id not held by an earlier
    slot of the row (each distinct id counted once)."""
    width = values.shape[1]
    same = values.unsqueeze(2) == values.unsqueeze(1)  # [row, j, k]: id j equals id k
    earlier = torch.ones(width, width, dtype=torch.bool, device=values.device).tril(-1)
    return mask & ~(same & earlier & mask.unsqueeze(1)).any(dim=2)


def overlap(candidate_ids: Ids, event_ids: Ids, events: Tensor, count: bool) -> Tensor:
    """``(N, W)`` int64: how much candidate ``n`` shares with event ``events[n, w]`` on one
    attribute. ``count``: the number of distinct candidate ids among the event's ids; otherwise
    1 if they share any (single-valued: 1 if the ids are equal)."""
    candidate, candidate_mask = padded_ids(candidate_ids)  # (N, C)
    event, event_mask = padded_ids(event_ids)  # (E, V)
    equal = candidate[:, :, None, None] == event[events].unsqueeze(1)  # (N, C, W, V)
    if event_mask is not None:
        equal = equal & event_mask[events].unsqueeze(1)
    present = equal.any(dim=3)  # (N, C, W): candidate id c is among the event's ids
    if candidate_mask is None:
        return present[:, 0].to(torch.int64)
    keep = first_occurrences(candidate, candidate_mask) if count else candidate_mask
    present = present & keep.unsqueeze(2)
    return present.sum(dim=1) if count else present.any(dim=1).to(torch.int64)


def younger_than(ages: Tensor, max_age_s: float) -> Tensor:
    """``ages < max_age_s``, exactly for integer ages (seconds)."""
    if ages.is_floating_point():
        return ages < max_age_s
    return ages < math.ceil(max_age_s)


#: The engaged-rank gates' factor is ``1 + GATE_SCALE * g``. Adam moves ``g`` by about the
#: learning rate a step whatever its scale, so at the dense 0.002 a factor needs 500 steps to
#: reach 0; in one pass of 295 steps on the Taobao-shaped log the gates found the rule's cut (up
#: for engaged ranks 1-9, down from 11) but moved 0.07 at most (docs/results.md). Ten times the
#: scale is ten times the learning rate for these few numbers alone.
GATE_SCALE = 10.0


def latest_match_features(grid: Tensor, classes: list[Tensor], dtype: torch.dtype) -> Tensor:
    """``(R, K, C * P * 2)``: for each request's candidates (``grid``, ``(R, K, span, P)``
    overlaps with the request's last ``span`` events, most recent first) and each class of
    events (``classes``: ``(R, span)`` masks, C of them), per attribute P: whether any event of
    the class matches, and ``log(1 + position) / log(1 + span)`` of the most recent one (0
    where none does). Computed with a minimum over positions (no loop on the data, so the
    model exports)."""
    span = grid.shape[2]
    position = torch.arange(span, device=grid.device).view(1, 1, span, 1)
    features = []
    for mask in classes:
        hit = (grid > 0) & mask[:, None, :, None]  # (R, K, span, P)
        first = torch.where(hit, position, span).amin(dim=2)  # (R, K, P); span: none
        present = first < span
        scaled = torch.log1p(first.clamp(max=span - 1).to(dtype)) / math.log1p(span)
        features.append(torch.stack([present.to(scaled.dtype),
                                     torch.where(present, scaled, 0.0)], dim=3))
    return torch.cat(features, dim=2).flatten(2)


#: Engaged ranks with a bucket each (``engaged_rank``); beyond, one per doubling.
EXACT_RANKS = 16


def rank_buckets(window: int) -> int:
    """How many engaged-rank buckets a window of ``window`` events needs (:func:`rank_bucket`
    of ranks 0 to ``window``)."""
    return EXACT_RANKS + 1 + max(0, math.ceil(math.log2(max(window, 1) / EXACT_RANKS)))


def rank_bucket(rank: Tensor, window: int) -> Tensor:
    """The bucket of each engaged rank (``rank``, int64, 0 to ``window``): ranks up to
    ``EXACT_RANKS`` are their own bucket, a rank in ``(16 * 2**(j-1), 16 * 2**j]`` is bucket
    ``16 + j``. Exact for integers, and a fixed number of comparisons (no loop on the data, so
    the model exports)."""
    above = (rank - 1).clamp(min=0) // EXACT_RANKS  # 0 up to rank 16, 1 for 17-32, 2-3, 4-7..
    doublings = sum((above >= (1 << j)).to(rank.dtype)
                    for j in range(rank_buckets(window) - EXACT_RANKS - 1))
    return torch.where(rank <= EXACT_RANKS, rank, EXACT_RANKS + doublings)


class TargetMatch(nn.Module):
    """Per candidate, the sums token: per shared attribute, the sum of a learned projection of
    the recent events that share an id with the candidate (weighted by the overlap), summed
    over attributes; with an action window, plus the same over the longer window's engaged
    events through their own projection. With ``latest``, a second token: an MLP of where the
    most recent match of each attribute (and kind of event) lies."""

    def __init__(self, dim: int, pairs: list[tuple[str, str]], window: int, *,
                 overlap: str = "count", action_feature: str = "", action_window: int = 0,
                 view_action: int = 0, engaged_limit: int = 0, engaged_rank: str = "none",
                 max_age_s: float = 0.0, latest: bool = False, latest_window: int = 0) -> None:
        super().__init__()
        if not pairs:
            raise GemConfigError("model.target_match needs a candidate feature and an event "
                                 "feature that share a table; the schema has none")
        if overlap not in OVERLAPS:
            raise GemConfigError(f"model.target_match_overlap must be one of "
                                 f"{', '.join(OVERLAPS)}; got {overlap!r}")
        if action_window and not action_feature:
            raise GemConfigError("model.target_match_action_window needs model.action_feature: "
                                 "the event feature holding each event's action")
        if action_feature and not (action_window or latest):
            raise ValueError("target match reads model.action_feature in its action window "
                             "(model.target_match_action_window) or its latest matches "
                             "(model.target_match_latest); neither is on")
        if window < 1 or min(action_window, max_age_s, engaged_limit, latest_window) < 0:
            raise GemConfigError("model.target_match must be >= 1, target_match_action_window, "
                                 "target_match_engaged_limit, target_match_max_age_s and "
                                 "target_match_latest_window >= 0")
        if latest_window and not latest:
            raise GemConfigError("model.target_match_latest_window needs model.target_match_latest")
        if engaged_rank not in ENGAGED_RANKS:
            raise GemConfigError(f"model.target_match_engaged_rank must be one of "
                                 f"{', '.join(ENGAGED_RANKS)}; got {engaged_rank!r}")
        if (engaged_limit or engaged_rank != "none") and not action_window:
            raise GemConfigError("model.target_match_engaged_limit and target_match_engaged_rank "
                                 "count the engaged events of the action window: they need "
                                 "model.target_match_action_window")
        if action_feature:
            check_view_action(view_action)
        self.pairs, self.window = pairs, window
        self.count = overlap == "count"
        self.action_feature, self.action_window = action_feature, action_window
        self.view_action, self.max_age_s = view_action, max_age_s
        self.engaged_limit = engaged_limit
        #: The events the latest matches read: their own window, else the longer of the two.
        self.latest_window = latest_window or max(window, action_window)
        self.values = nn.Linear(dim, dim * len(pairs), bias=False)
        self.engaged_values = (nn.Linear(dim, dim * len(pairs), bias=False)
                               if action_window else None)
        self.engaged_rank = (nn.Embedding(rank_buckets(action_window), dim)
                             if engaged_rank == "vector" else None)
        if self.engaged_rank is not None:
            # Zero: the sums start as they are without ranks (nn.Embedding's N(0, 1) rows
            # would swamp event tokens a few hundredths in size), and learn what ranks add.
            nn.init.zeros_(self.engaged_rank.weight)
        # A match of engaged rank r weighs 1 + GATE_SCALE * gate[bucket(r)]: 1 at first (as
        # without ranks); 0 where a rank stops counting, the limit learned.
        self.engaged_gate = (nn.Parameter(torch.zeros(rank_buckets(action_window)))
                             if engaged_rank == "gate" else None)
        # Latest matches: per class of events (views and engaged, or all) and attribute, a
        # flag and a scaled position.
        classes = 2 if action_feature else 1
        self.latest = (nn.Sequential(nn.Linear(2 * classes * len(pairs), dim), nn.SiLU(),
                                     nn.Linear(dim, dim)) if latest else None)
        if self.latest is not None:
            # Zero: the token starts as it is without, and learns what the positions add.
            nn.init.zeros_(self.latest[2].weight)
            nn.init.zeros_(self.latest[2].bias)
        self.proj = nn.Linear(dim, dim)
        #: Tokens per candidate: the sums, then the latest matches.
        self.tokens = 1 + int(latest)

    def forward(self, history: Tensor, offsets: Tensor, owner: Tensor,
                candidate_ids: Mapping[str, Ids], event_ids: Mapping[str, Ids], *,
                candidate_offsets: Tensor | None = None, max_candidates: int | None = None,
                ages: Tensor | None = None) -> Tensor:
        """``history`` ``(E, d)`` event tokens; ``owner`` ``(N,)`` each candidate's request;
        ``candidate_offsets`` ``(R + 1,)`` and ``max_candidates`` (the most of one request)
        cut the candidates into requests (None: derived from ``owner``); ``ages`` ``(E,)``
        each event's age at its request in seconds (needed with ``max_age_s``).
        Returns ``(N, tokens, d)``: the sums, then (with ``latest``) the latest matches."""
        n, dim = owner.numel(), history.shape[1]
        if history.shape[0] == 0:
            tokens = [self.proj(history.new_zeros(n, dim))]
            if self.latest is not None:  # no match anywhere: every flag and position 0
                tokens.append(self.latest(history.new_zeros(n, self.latest[0].in_features)))
            return torch.stack(tokens, dim=1)
        requests, device = offsets.numel() - 1, offsets.device
        if candidate_offsets is None or max_candidates is None:
            counts = torch.bincount(owner, minlength=requests)
            candidate_offsets, max_candidates = offsets_from_lengths(counts), max_length(counts)
        # Every request's last `span` events (every window: the shorter are prefixes).
        span = max(self.window, self.action_window,
                   self.latest_window if self.latest is not None else 0)
        index, valid = recent_event_index(offsets, torch.arange(requests, device=device), span)
        if self.max_age_s:
            if ages is None:
                raise GemConfigError("model.target_match_max_age_s needs the events' ages")
            valid = valid & younger_than(ages[index], self.max_age_s)
        # Overlaps of each candidate with its request's events, then laid out per request:
        # (R, K, span, P), K the candidates of the widest request.
        events = index[owner]
        weights = torch.stack([overlap(candidate_ids[candidate], event_ids[event], events,
                                       self.count) for candidate, event in self.pairs], dim=2)
        slot = torch.arange(n, device=device) - candidate_offsets[:-1][owner]
        grid = weights.new_zeros(requests, max_candidates, span, len(self.pairs)).index_put_(
            (owner, slot), weights)
        # The sums' events only (the latest matches read overlaps, not tokens): gathered rather
        # than sliced from a longer span, whose strided slice torch.export could only fold
        # into the projection's matmul for two or more requests.
        tokens = history[index[:, :max(self.window, self.action_window)]]  # (R, sums' span, d)
        windows = [(self.window, valid, self.values, tokens)]
        if self.action_feature:
            actions = event_ids[self.action_feature]
            if isinstance(actions, Jagged):
                raise GemConfigError(f"model.action_feature {self.action_feature!r} "
                                     "must be single-valued (one action per event)")
            engaged = valid & (actions[index] != self.view_action)
        latest = None
        if self.latest is not None:
            width = self.latest_window
            classes = [valid & ~engaged, engaged] if self.action_feature else [valid]
            latest = self.latest(latest_match_features(
                grid[:, :, :width], [mask[:, :width] for mask in classes], history.dtype))
        if self.engaged_values is not None:
            # index runs most recent first, so the running count is each engaged event's rank
            # among the engaged events (1 for the latest).
            rank = engaged.cumsum(dim=1)
            if self.engaged_limit:
                engaged = engaged & (rank <= self.engaged_limit)
            width = self.action_window
            engaged_tokens, engaged = tokens[:, :width], engaged[:, :width]
            if self.engaged_rank is not None or self.engaged_gate is not None:
                buckets = rank_bucket(rank[:, :width], width)
                if self.engaged_rank is not None:
                    engaged_tokens = engaged_tokens + self.engaged_rank(buckets)
                if self.engaged_gate is not None:
                    engaged = engaged * (1 + GATE_SCALE * self.engaged_gate[buckets])
            windows.append((self.action_window, engaged, self.engaged_values, engaged_tokens))
        values = torch.cat([project(window_tokens[:, :width]).reshape(requests, -1, dim)
                            for width, _, project, window_tokens in windows],
                           dim=1)  # (R, slots * P, d)
        weight = torch.cat([(grid[:, :, :width] * mask[:, None, :width, None]).flatten(2)
                            .to(values.dtype) for width, mask, _, _ in windows], dim=2)
        summed = torch.bmm(weight, values)[owner, slot]  # (N, d)
        if latest is None:
            return self.proj(summed).unsqueeze(1)
        return torch.stack([self.proj(summed), latest[owner, slot]], dim=1)

    def flops(self, lengths: Tensor, candidates: Tensor) -> int:
        """Forward FLOPs (matmuls) of a batch of requests with these history lengths and
        ``candidates`` per request: the value projections of every request's window(s), the
        weighted sums (one batched matmul over the candidates padded to the widest request),
        the output projection of every candidate."""
        impressions = int(candidates.sum())
        total = linear_layer_flops(self.proj, impressions)
        if not int(lengths.sum()):  # the latest matches' MLP still runs, once per candidate
            return total + (self._latest_flops(impressions) if self.latest is not None else 0)
        requests, widest = lengths.numel(), int(candidates.max())
        if self.latest is not None:  # its MLP runs on every candidate slot of every request
            total += self._latest_flops(requests * widest)
        total += linear_layer_flops(self.values, requests * self.window)
        slots = self.window
        if self.engaged_values is not None:
            total += linear_layer_flops(self.engaged_values, requests * self.action_window)
            slots += self.action_window
        return total + 2 * requests * widest * slots * self.values.out_features

    def _latest_flops(self, rows: int) -> int:
        """FLOPs of the latest matches' MLP on ``rows`` rows."""
        return sum(linear_layer_flops(layer, rows)
                   for layer in self.latest if isinstance(layer, nn.Linear))


def check_action_feature(schema: FeatureSchema, name: str) -> None:
    """Raise ValueError unless ``name`` (``model.action_feature``) is a single-valued event
    feature of ``schema``."""
    features = {feature.name: feature for feature in schema.event_features}
    if name not in features:
        raise GemConfigError(f"model.action_feature = {name!r} is not an event "
                             f"feature of the data; its event features: {', '.join(features)}")
    if features[name].multi_valued:
        raise GemConfigError(f"model.action_feature = {name!r} is multi-valued; "
                             "engaged events are told by a single-valued event feature (one action "
                             "per event)")


def check_view_action(view_action: int | str) -> None:
    """Raise GemConfigError unless ``view_action`` (``model.view_action``) is an integer id:
    the model compares it with the event ids, and a text (``"pv"``) compared with a tensor
    would silently match nothing. The trainer resolves a text to its id from the data
    source's vocabulary at start-up; whatever builds a model from a configuration elsewhere
    must do the same first."""
    if isinstance(view_action, bool) or not isinstance(view_action, int):
        raise GemConfigError(
            f"model.view_action = {view_action!r} reached the model unresolved: it must be the "
            "action's raw id (an integer); a text is looked up in the data set's vocabulary "
            "when gem train starts (DataSource.raw_id), and this model was built from a "
            "configuration that was not")


def target_match_from_config(dim: int, config: ModelConfig,
                             schema: FeatureSchema) -> TargetMatch | None:
    """The target match of ``config`` (``model.target_match*``) on ``schema``; None when
    ``model.target_match`` is 0. Raises ValueError naming the option the schema cannot serve."""
    name, window = config.action_feature, config.target_match_action_window
    latest = latest_by_action(config)
    if not config.target_match:
        if config.target_match_engaged_limit or config.target_match_engaged_rank != "none":
            raise GemConfigError("model.target_match_engaged_limit and target_match_engaged_rank "
                                 "shape target match's action window, and model.target_match is 0 "
                                 "(off)")
        # "with_actions" is a preset's "where it applies", and it does not apply here.
        if config.target_match_latest is True:
            raise GemConfigError("model.target_match_latest is part of target match, and "
                                 "model.target_match is 0 (off)")
        return None
    if window and not name:
        raise GemConfigError(f"model.target_match_action_window = {window} needs "
                             "model.action_feature: the event feature holding each "
                             "event's action type")
    if config.target_match_latest_window and not config.target_match_latest:
        raise GemConfigError("model.target_match_latest_window is the window of the latest-match "
                             "token, and model.target_match_latest is off")
    by_action = window or (latest and name)
    if by_action:
        check_action_feature(schema, name)
    return TargetMatch(dim, shared_attributes(schema), config.target_match,
                       overlap=config.target_match_overlap,
                       action_feature=name if by_action else "",
                       action_window=window, view_action=config.view_action,
                       engaged_limit=config.target_match_engaged_limit,
                       engaged_rank=config.target_match_engaged_rank,
                       max_age_s=config.target_match_max_age_s, latest=latest,
                       latest_window=min(config.target_match_latest_window,
                                         schema.max_seq_len) if latest else 0)
