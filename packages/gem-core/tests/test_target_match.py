"""Target match against a plain-Python float64 oracle: single- and multi-valued attributes
(overlap counts), the action window (and its limit counted in engaged events) and the age limit;
its validation and its gradients."""

import math
import random

import attrs
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from gem_core.jagged import Jagged, offsets_from_lengths
from gem_core.model.target_match import GATE_SCALE, TargetMatch, shared_attributes
from gem_core.schema import EmbeddingTable, FeatureSchema, SequenceFeature
from gem_core.testing.models import small_model, synthetic_batch

# Raw 64-bit ids: near 2**62 (neighbours a float64 cannot tell apart), negative, the extremes.
POOL = ([(1 << 62) + i for i in range(4)] + [-(1 << 62) - i for i in range(3)]
        + [(1 << 63) - 1, -(1 << 63), 7])
VIEW = 5  # the "view" action id of these tests (not 0, so the default is not relied on)

# candidate feature, event feature, and whether each side is multi-valued
FEATURES = {  # name: (table, candidate multi-valued, event multi-valued); None: not on that side
    "ad": ("ad", False, False),
    "topics": ("topic", True, True),
    "advertiser": ("advertiser", False, None),
    "advertisers": ("advertiser", None, True),
    "genres": ("genre", True, None),
    "genre": ("genre", None, False),
    "action": ("action", None, False),
}


def schema() -> FeatureSchema:
    tables = sorted({table for table, _, _ in FEATURES.values()})
    return FeatureSchema(
        tables=[EmbeddingTable(name=t, num_embeddings=10, id_policy="hash") for t in tables],
        event_features=[SequenceFeature(name=n, table=t, multi_valued=m)
                        for n, (t, _, m) in FEATURES.items() if m is not None],
        candidate_features=[SequenceFeature(name=n, table=t, multi_valued=m)
                            for n, (t, m, _) in FEATURES.items() if m is not None],
        tasks=("click",))


PAIRS = [("ad", "ad"), ("topics", "topics"), ("advertiser", "advertisers"),
         ("genres", "genre")]


def draw(rng: random.Random, multi: bool, planted: list[int]) -> list[int]:
    """Ids of one event or candidate: from the pool or, half of the time, one of ``planted``
    (ids of the request's events, so matches happen), with repeats in multi-valued rows."""
    def one() -> int:
        return rng.choice(planted) if planted and rng.random() < 0.5 else rng.choice(POOL)
    if not multi:
        return [one()]
    ids = [one() for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.3:
        ids.append(rng.choice(ids))  # a repeated id counts once
    return ids


def random_batch(seed: int, lengths: list[int], candidates: list[int]) -> dict:
    """Python lists of one batch: per request its events (ids per feature, timestamps) and its
    candidates (ids per feature)."""
    rng = random.Random(seed)
    events, cands, owner = [], [], []
    request_ts = [10_000 + 100 * r for r in range(len(lengths))]
    for r, (length, count) in enumerate(zip(lengths, candidates)):
        first = len(events)
        for _ in range(length):
            event = {name: draw(rng, m, []) for name, (_, _, m) in FEATURES.items()
                     if m is not None and name != "action"}
            event["action"] = [rng.choice([VIEW, VIEW, VIEW, 1, 2, -3])]
            event["time"] = request_ts[r] - rng.randint(1, 3000)
            events.append(event)
        mine = events[first:]
        for _ in range(count):
            candidate = {}
            for name, (table, m, _) in FEATURES.items():
                if m is None:
                    continue
                planted = [i for e in mine for n, (t, _, em) in FEATURES.items()
                           if em is not None and t == table for i in e[n]]
                candidate[name] = draw(rng, m, planted)
            cands.append(candidate)
            owner.append(r)
    # the events' times are in request order, oldest first: sort each request's events
    cut = [0]
    for length in lengths:
        cut.append(cut[-1] + length)
    for r in range(len(lengths)):
        events[cut[r]:cut[r + 1]] = sorted(events[cut[r]:cut[r + 1]], key=lambda e: e["time"])
    return dict(events=events, candidates=cands, owner=owner, cut=cut, request_ts=request_ts)


def as_ids(rows: list[list[int]], multi: bool):
    if not multi:
        return torch.tensor([row[0] for row in rows], dtype=torch.int64)
    lengths = torch.tensor([len(row) for row in rows], dtype=torch.int64)
    return Jagged(torch.tensor([i for row in rows for i in row], dtype=torch.int64),
                  offsets_from_lengths(lengths))


def module_inputs(data: dict) -> dict:
    events, cands = data["events"], data["candidates"]
    event_ids = {n: as_ids([e[n] for e in events], m)
                 for n, (_, _, m) in FEATURES.items() if m is not None}
    candidate_ids = {n: as_ids([c[n] for c in cands], m)
                     for n, (_, m, _) in FEATURES.items() if m is not None}
    offsets = torch.tensor(data["cut"], dtype=torch.int64)
    owner = torch.tensor(data["owner"], dtype=torch.int64)
    counts = torch.bincount(owner, minlength=offsets.numel() - 1)
    rows = torch.repeat_interleave(torch.arange(offsets.numel() - 1), offsets.diff())
    ages = (torch.tensor(data["request_ts"], dtype=torch.int64)[rows]
            - torch.tensor([e["time"] for e in events], dtype=torch.int64))
    return dict(offsets=offsets, owner=owner, candidate_ids=candidate_ids, event_ids=event_ids,
                candidate_offsets=offsets_from_lengths(counts), max_candidates=int(counts.max()),
                ages=ages)


def matvec(matrix: list[list[float]], vector: list[float]) -> list[float]:
    return [sum(a * b for a, b in zip(row, vector)) for row in matrix]


def oracle(match: TargetMatch, history: torch.Tensor, data: dict, *, count: bool,
           window: int, action_window: int = 0, max_age: float = 0.0,
           engaged_limit: int = 0, engaged_rank: str = "none", **_) -> torch.Tensor:
    """The sums token of every candidate, by loops over candidates, their request's events
    (most recent first) and the shared attributes, in Python floats."""
    d = history.shape[1]
    h = history.tolist()
    values = match.values.weight.tolist()
    engaged = match.engaged_values.weight.tolist() if action_window else None
    ranks = match.engaged_rank.weight.tolist() if engaged_rank == "vector" else None
    gates = match.engaged_gate.tolist() if engaged_rank == "gate" else None
    proj_w, proj_b = match.proj.weight.tolist(), match.proj.bias.tolist()
    out = []
    for n, candidate in enumerate(data["candidates"]):
        r = data["owner"][n]
        acc = [0.0] * d
        recent_first = list(range(data["cut"][r + 1] - 1, data["cut"][r] - 1, -1))
        engaged_seen = 0  # engaged events of the action window met so far, most recent first
        for rank, e in enumerate(recent_first):
            event = data["events"][e]
            if max_age and not data["request_ts"][r] - event["time"] < max_age:
                continue
            engaged_here = rank < action_window and event["action"][0] != VIEW
            engaged_seen += engaged_here
            within_limit = not engaged_limit or engaged_seen <= engaged_limit
            for p, (cf, ef) in enumerate(PAIRS):
                shared = set(candidate[cf]) & set(event[ef])
                weight = len(shared) if count else float(bool(shared))
                if not weight:
                    continue
                terms = []
                if rank < window:
                    terms.append((values, h[e], 1.0))
                if engaged is not None and engaged_here and within_limit:
                    token, factor = h[e], 1.0
                    # ranks 1-16 their own bucket, then one per doubling
                    bucket = (engaged_seen if engaged_seen <= 16
                              else 16 + math.ceil(math.log2(engaged_seen / 16)))
                    if ranks is not None:
                        token = [a + b for a, b in zip(token, ranks[bucket])]
                    if gates is not None:
                        factor = 1.0 + GATE_SCALE * gates[bucket]
                    terms.append((engaged, token, factor))
                for matrix, token, factor in terms:
                    projected = matvec(matrix[p * d:(p + 1) * d], token)
                    acc = [a + weight * factor * v for a, v in zip(acc, projected)]
        out.append([b + s for b, s in zip(proj_b, matvec(proj_w, acc))])
    return torch.tensor(out, dtype=torch.float64).reshape(len(data["candidates"]), d)


def latest_oracle(match: TargetMatch, data: dict, *, window: int, action_window: int = 0,
                  max_age: float = 0.0, by_action: bool = False, latest_window: int = 0,
                  **_) -> torch.Tensor:
    """The latest matches' token of every candidate: per class of events (views, then
    engaged; or all) and attribute, a flag and log(1 + position) / log(1 + span) of the most
    recent matching event among the last ``span`` events (``latest_window``, else the longer
    window), through the MLP, in Python floats."""
    span = latest_window or max(window, action_window)
    return torch.tensor([latest_one(match, data, candidate, data["owner"][n], span, max_age,
                                    by_action)
                         for n, candidate in enumerate(data["candidates"])],
                        dtype=torch.float64)


def latest_one(match: TargetMatch, data: dict, candidate: dict, r: int, span: int,
               max_age: float, by_action: bool) -> list[float]:
    recent_first = list(range(data["cut"][r + 1] - 1, data["cut"][r] - 1, -1))
    classes = [lambda a: a == VIEW, lambda a: a != VIEW] if by_action else [lambda a: True]
    features = []
    for in_class in classes:
        for cf, ef in PAIRS:
            position = None
            for rank, e in enumerate(recent_first[:span]):
                event = data["events"][e]
                if max_age and not data["request_ts"][r] - event["time"] < max_age:
                    continue
                if in_class(event["action"][0]) and set(candidate[cf]) & set(event[ef]):
                    position = rank
                    break
            features += ([0.0, 0.0] if position is None
                         else [1.0, math.log(1 + position) / math.log(1 + span)])
    first, _, second = match.latest
    hidden = [v + b for v, b in zip(matvec(first.weight.tolist(), features),
                                    first.bias.tolist())]
    hidden = [v / (1 + math.exp(-v)) for v in hidden]  # SiLU
    return [v + b for v, b in zip(matvec(second.weight.tolist(), hidden),
                                  second.bias.tolist())]


CASES = {
    "count": dict(count=True, window=4),
    "any": dict(count=False, window=3),
    "action-window": dict(count=True, window=2, action_window=7),
    "action-window-shorter": dict(count=True, window=6, action_window=3),
    "age-limit": dict(count=True, window=5, max_age=1500.5),
    "all": dict(count=False, window=3, action_window=8, max_age=2000.0),
    "engaged-limit": dict(count=True, window=2, action_window=9, engaged_limit=2),
    "engaged-limit-aged": dict(count=False, window=3, action_window=10, engaged_limit=1,
                               max_age=2500.0),
    "engaged-rank": dict(count=True, window=2, action_window=11, engaged_rank="vector"),
    "engaged-rank-limited": dict(count=False, window=7, action_window=4, engaged_limit=2,
                                 engaged_rank="vector"),
    "engaged-gate": dict(count=True, window=3, action_window=10, engaged_rank="gate"),
    "engaged-gate-aged": dict(count=False, window=2, action_window=9, engaged_rank="gate",
                              max_age=2200.0),
    "latest": dict(count=True, window=6, latest=True),
    "latest-by-action": dict(count=True, window=4, latest=True, by_action=True),
    "latest-by-action-window": dict(count=False, window=2, action_window=9, latest=True,
                                    by_action=True, max_age=2600.0),
    # a window of the latest matches' own, longer and shorter than the sums'
    "latest-own-window": dict(count=True, window=2, latest=True, by_action=True,
                              latest_window=10),
    "latest-own-window-shorter": dict(count=False, window=6, action_window=8, latest=True,
                                      by_action=True, latest_window=3),
}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", CASES)
def test_matches_the_oracle(case, seed):
    options = CASES[case]
    # lengths include empty histories and ones longer than every window
    data = random_batch(seed, lengths=[6, 0, 11, 1, 9, 0], candidates=[3, 2, 4, 1, 2, 1])
    torch.manual_seed(seed)
    d = 5
    action_window = options.get("action_window", 0)
    by_action = action_window or options.get("by_action")
    match = TargetMatch(d, PAIRS, options["window"],
                        overlap="count" if options["count"] else "any",
                        action_feature="action" if by_action else "",
                        action_window=action_window, view_action=VIEW,
                        engaged_limit=options.get("engaged_limit", 0),
                        engaged_rank=options.get("engaged_rank", "none"),
                        max_age_s=options.get("max_age", 0.0),
                        latest=options.get("latest", False),
                        latest_window=options.get("latest_window", 0)).double()
    # zero at first (as without ranks): test on values
    if match.engaged_rank is not None:
        torch.nn.init.normal_(match.engaged_rank.weight)
    if match.engaged_gate is not None:
        torch.nn.init.normal_(match.engaged_gate)
    if match.latest is not None:
        torch.nn.init.normal_(match.latest[2].weight)
        torch.nn.init.normal_(match.latest[2].bias)
    history = torch.randn(len(data["events"]), d, dtype=torch.float64)
    both = match(history, **module_inputs(data))
    assert both.shape[1] == match.tokens == 1 + int(options.get("latest", False))
    out = both[:, 0]
    expected = oracle(match, history, data, **options)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    # The batch has matches of every kind, and candidates with none.
    bias = match.proj.bias.detach().expand_as(out)
    unmatched = torch.isclose(expected, bias).all(dim=1)
    assert unmatched.any() and not unmatched.all()
    if options.get("engaged_rank", "none") != "none":
        # the rank vectors (gates) reach the tokens: without them the tokens differ
        with torch.no_grad():
            for weight in (match.engaged_rank, match.engaged_gate):
                if weight is not None:
                    (weight.weight if isinstance(weight, torch.nn.Embedding) else weight).zero_()
        assert not torch.allclose(match(history, **module_inputs(data))[:, 0], out)
    if options.get("latest"):
        latest = both[:, 1]
        torch.testing.assert_close(latest, latest_oracle(match, data, **options),
                                   rtol=1e-10, atol=1e-10)
        # candidates' latest matches differ (the positions reach the token)
        assert not torch.allclose(latest, latest[:1].expand_as(latest))
    if options.get("engaged_limit"):
        # the batch has engaged matches beyond the limit, which the limit leaves out
        unlimited = oracle(match, history, data, **{**options, "engaged_limit": 0})
        assert not torch.allclose(expected, unlimited)


def test_engaged_ranks_fall_in_exact_buckets_then_one_per_doubling():
    from gem_core.model.target_match import rank_bucket, rank_buckets

    for window in (1, 16, 17, 256, 5000):
        ranks = torch.arange(window + 1)
        expected = [r if r <= 16 else 16 + math.ceil(math.log2(r / 16)) for r in range(window + 1)]
        assert rank_bucket(ranks, window).tolist() == expected
        # none beyond the table; from a window of 16 on, every bucket is used
        assert max(expected) <= rank_buckets(window) - 1
        assert window < 16 or max(expected) == rank_buckets(window) - 1


def test_overlap_counts_distinct_candidate_ids_and_compares_exactly():
    """Hand-made: ids that a float64 cannot tell apart, repeats on both sides, a negative id."""
    big = 1 << 62
    # one request, 3 events (oldest first), 3 candidates
    event_topics = Jagged(torch.tensor([big, big + 1, big + 1,   # event 0
                                        -5,                     # event 1
                                        big + 2, -5, big]),     # event 2
                          torch.tensor([0, 3, 4, 7]))
    candidate_topics = Jagged(torch.tensor([big, big, big + 1,  # both of event 0's, repeated
                                            big + 3,            # nowhere
                                            -5, big + 2]),      # event 1 once, event 2 twice
                              torch.tensor([0, 3, 4, 6]))
    match = TargetMatch(2, [("topics", "topics")], window=3).double()
    with torch.no_grad():
        match.values.weight.copy_(torch.eye(2, dtype=torch.float64))
        match.proj.weight.copy_(torch.eye(2, dtype=torch.float64))
        match.proj.bias.zero_()
    history = torch.tensor([[1.0, 0.0], [0.0, 1.0], [10.0, 10.0]], dtype=torch.float64)
    args = (history, torch.tensor([0, 3]), torch.tensor([0, 0, 0]),
            {"topics": candidate_topics}, {"topics": event_topics})
    expected = torch.tensor([[2.0 + 10.0, 10.0],  # 2 distinct ids in event 0, 1 (big) in event 2
                             [0.0, 0.0],
                             [20.0, 1.0 + 20.0]], dtype=torch.float64)
    torch.testing.assert_close(match(*args)[:, 0], expected)
    match.count = False
    torch.testing.assert_close(match(*args)[:, 0], torch.tensor(
        [[11.0, 10.0], [0.0, 0.0], [10.0, 11.0]], dtype=torch.float64))


def test_no_history_at_all_gives_the_bias():
    data = random_batch(3, lengths=[0, 0], candidates=[2, 1])
    match = TargetMatch(4, PAIRS, 3, action_feature="action", action_window=5,
                        view_action=VIEW, max_age_s=10.0).double()
    out = match(torch.zeros(0, 4, dtype=torch.float64), **module_inputs(data))
    torch.testing.assert_close(out[:, 0], match.proj.bias.detach().expand(3, 4))
    # with the latest matches: their token says "no match of any kind" (flags and positions 0)
    latest = TargetMatch(4, PAIRS, 3, action_feature="action", view_action=VIEW,
                         latest=True).double()
    torch.nn.init.normal_(latest.latest[2].weight)
    with FlopCounterMode(display=False) as counter:
        out = latest(torch.zeros(0, 4, dtype=torch.float64), **module_inputs(data))
    torch.testing.assert_close(out[:, 1], latest.latest(torch.zeros(3, 16, dtype=torch.float64)))
    # its FLOPs are counted there too (no events: the MLP and the output projection)
    assert latest.flops(torch.zeros(2, dtype=torch.int64),
                        torch.tensor([2, 1])) == counter.get_total_flops()


def test_gradients_reach_the_matched_events_and_both_projections():
    data = random_batch(5, lengths=[12, 4, 0], candidates=[3, 2, 2])
    torch.manual_seed(0)
    match = TargetMatch(6, PAIRS, 3, action_feature="action", action_window=12,
                        view_action=VIEW)
    history = torch.randn(len(data["events"]), 6, requires_grad=True)
    match(history, **module_inputs(data)).square().sum().backward()  # (N, 1, d)
    for parameter in (match.values.weight, match.engaged_values.weight, match.proj.weight):
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0
    assert history.grad.abs().sum() > 0
    # An event no candidate shares anything with gets no gradient.
    inputs = module_inputs(data)
    shares = torch.zeros(len(data["events"]), dtype=torch.bool)
    for candidate, r in zip(data["candidates"], data["owner"]):
        for e in range(data["cut"][r], data["cut"][r + 1]):
            if any(set(candidate[cf]) & set(data["events"][e][ef]) for cf, ef in PAIRS):
                shares[e] = True
    assert inputs["offsets"][-1] == len(shares)
    assert (history.grad[~shares] == 0).all()


def test_shared_attributes_include_multi_valued_ones():
    assert shared_attributes(schema()) == PAIRS


def test_the_model_validates_the_options_and_passes_the_ages():
    s = schema()
    with pytest.raises(ValueError, match="action_feature = 'nope'.*not an event"):
        small_model(s, target_match=4, action_feature="nope",
                    target_match_action_window=16)
    with pytest.raises(ValueError, match="action_feature = 'topics'.*multi-valued"):
        small_model(s, target_match=4, action_feature="topics",
                    target_match_action_window=16)
    with pytest.raises(ValueError, match="target_match_action_window = 16 needs"):
        small_model(s, target_match=4, target_match_action_window=16)
    # The action feature alone is model-wide (retrieval reads it too): no action window.
    assert small_model(s, target_match=4, action_feature="action").target_match.action_window == 0
    with pytest.raises(ValueError, match="action_feature = 'nope'.*not an event"):
        small_model(s, attribute_attention=True, attribute_attention_retrieve=4,
                    attribute_attention_retrieve_engaged=True, action_feature="nope")
    with pytest.raises(ValueError, match="attribute_attention_retrieve_engaged needs"):
        small_model(s, attribute_attention=True, attribute_attention_retrieve=4,
                    attribute_attention_retrieve_engaged=True)
    model = small_model(s, target_match=4, action_feature="action",
                        target_match_action_window=16, view_action=VIEW,
                        target_match_max_age_s=60.0)
    assert model.target_match.action_window == 16 and model.target_match.view_action == VIEW
    assert small_model(s).target_match is None
    for option, value in (("target_match_engaged_limit", 2),
                          ("target_match_engaged_rank", "vector"),
                          ("target_match_engaged_rank", "gate")):
        with pytest.raises(ValueError, match="count the engaged events of the action window"):
            small_model(s, target_match=4, **{option: value})
        with pytest.raises(ValueError, match="shape target match's action window.*is 0"):
            small_model(s, **{option: value})
    limited = small_model(s, target_match=4, action_feature="action", view_action=VIEW,
                          target_match_action_window=16, target_match_engaged_limit=3)
    assert limited.target_match.engaged_limit == 3 and limited.target_match.engaged_rank is None
    ranked = small_model(s, target_match=4, action_feature="action", view_action=VIEW,
                         target_match_action_window=40, target_match_engaged_rank="vector")
    # ranks 0-16, then 17-32 and 33-64: one row each, zero until trained
    assert ranked.target_match.engaged_rank.weight.shape[0] == 19
    assert not ranked.target_match.engaged_rank.weight.any()
    # Latest matches: views and engaged events apart where the action feature is named
    # (2 classes x 4 attributes x flag and position), all events together otherwise.
    by_action = small_model(s, target_match=4, action_feature="action", view_action=VIEW,
                            target_match_latest=True).target_match
    assert by_action.latest[0].in_features == 16 and by_action.action_window == 0
    assert small_model(s, target_match=4, target_match_latest=True
                       ).target_match.latest[0].in_features == 8
    with pytest.raises(ValueError, match="target_match_latest is part of target match"):
        small_model(s, target_match_latest=True)
    with pytest.raises(ValueError, match="neither is on"):
        TargetMatch(4, PAIRS, 4, action_feature="action", view_action=VIEW)
    gated = small_model(s, target_match=4, action_feature="action", view_action=VIEW,
                        target_match_action_window=40, target_match_engaged_rank="gate")
    assert gated.target_match.engaged_gate.shape == (19,)
    assert not gated.target_match.engaged_gate.any() and gated.target_match.engaged_rank is None

    # In the model: the ages of the events at their requests reach target match, and the
    # whole thing trains.
    schema_, batch = synthetic_batch(4, max_seq_len=20, seed=1, candidates=3)
    # plant a match: the first candidate gets the item of the last engaged event of the batch
    engaged = torch.nonzero(batch.event_ids["action"] != 0)[-1, 0]
    request = int(torch.searchsorted(batch.seq_offsets, engaged, right=True)) - 1
    items = batch.candidate_ids["item"].clone()
    items[batch.candidate_offsets[request]] = batch.event_ids["item"][engaged]
    batch = attrs.evolve(batch, candidate_ids={**batch.candidate_ids, "item": items})
    model = small_model(schema_, target_match=4, action_feature="action",
                        target_match_action_window=12, target_match_max_age_s=1e9)
    seen = {}
    model.target_match.register_forward_hook(
        lambda module, args, kwargs, out: seen.update(kwargs), with_kwargs=True)
    logits = model(batch)
    rows = torch.repeat_interleave(torch.arange(batch.batch_size), batch.seq_lengths())
    torch.testing.assert_close(seen["ages"], batch.request_timestamps[rows]
                               - batch.seq_timestamps)
    torch.testing.assert_close(seen["candidate_offsets"], batch.candidate_offsets)
    assert seen["max_candidates"] == 3
    sum(logit.sum() for logit in logits.values()).backward()
    assert model.target_match.engaged_values.weight.grad.abs().sum() > 0
    # the latest matches' MLP starts at zero and learns: its last layer gets a gradient
    latest = small_model(schema_, target_match=4, action_feature="action",
                         target_match_latest=True)
    sum(logit.sum() for logit in latest(batch).values()).backward()
    assert latest.target_match.latest[2].weight.grad.abs().sum() > 0
