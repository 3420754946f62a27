"""The planted label kinds of the synthetic-ads generator (``SynthOptions.planted``): each kind's
true probabilities are its documented formula (recomputed here by a plain per-candidate loop),
its main indicator fires often, a logistic regression on its indicators comes near the
achievable NE, and the default ``ads`` kind is the data of before, byte for byte."""

from __future__ import annotations

import hashlib
import math

import attrs
import numpy as np
import pytest
import torch

from gem_core.config import DataConfig
from gem_data.generator import AdsLogGenerator, achievable_ne
from gem_data.indicator_ne import fit_logistic, indicator_regression_ne
from gem_data.synth_options import SynthOptions

KINDS = ("multi_valued", "rare_action", "hierarchy", "order", "cross")

# A smaller world than the defaults with histories long enough for every kind's terms.
WORLD = dict(num_items=5000, num_users=2000, max_length=128)
LONG = dict(max_length=400)  # rare_action: its long window needs long histories


def options(kind: str, **changes) -> SynthOptions:
    return SynthOptions(**{**WORLD, **(LONG if kind == "rare_action" else {}), **changes},
                        planted=kind)


@pytest.fixture(scope="module", params=KINDS)
def generator(request):
    return AdsLogGenerator(options(request.param), seed=0)


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _events(batch, r: int) -> list[dict]:
    """Request ``r``'s history, oldest first, one dict per event (plain Python values)."""
    s, e = int(batch.seq_offsets[r]), int(batch.seq_offsets[r + 1])
    ids = batch.event_ids
    events = []
    for i in range(s, e):
        event = {"adv": int(ids["advertiser"][i]), "cat": int(ids["category"][i]),
                 "act": int(ids["action"][i])}
        if "topics" in ids:
            lo, hi = int(ids["topics"].offsets[i]), int(ids["topics"].offsets[i + 1])
            event["topics"] = set(ids["topics"].values[lo:hi].tolist())
        events.append(event)
    return events


def _oracle(generator, batch) -> tuple[list[float], list[float], list[bool], list[int | None]]:
    """P(click), P(conversion) and the main term of every candidate from the docstring's
    formula of the kind, computed event by event; and, for ``rare_action``, how far back
    (events from the end) the most recent event that fires its main term is (None where it
    does not fire)."""
    o = generator.options
    parent = generator.planted_world.category_parent
    p_click, p_conv, mains, fired_at = [], [], [], []
    cand = batch.candidate_ids
    for r in range(batch.batch_size):
        history = _events(batch, r)
        recent = history[::-1][:o.recent_window]  # the most recent first
        back = history[::-1]
        weights = [math.exp(-i / 64.0) * (1.0, 3.0, 6.0)[ev["act"]] for i, ev in enumerate(back)]
        segment = int(batch.sparse["user_segment"].values[
            int(batch.sparse["user_segment"].offsets[r])])
        context = int(batch.sparse["context"].values[r])
        dense = batch.dense[r].double().tolist()
        request = 0.5 * dense[0] + 0.6 * (segment % 4 == 0) + 0.3 * (context == 3)
        for c in range(int(batch.candidate_offsets[r]), int(batch.candidate_offsets[r + 1])):
            adv, cat = int(cand["advertiser"][c]), int(cand["category"][c])
            total = sum(weights)
            affinity = (sum(w for w, ev in zip(weights, back) if ev["cat"] == cat) / total
                        if total else 0.0)
            where = None
            if o.planted == "multi_valued":
                lo, hi = int(cand["topics"].offsets[c]), int(cand["topics"].offsets[c + 1])
                topics = set(cand["topics"].values[lo:hi].tolist())
                overlap = len({t for t in topics
                               if any(t in ev["topics"] and ev["act"] >= 1 for ev in recent)})
                shares = any(topics & ev["topics"] for ev in recent)
                terms = o.topic_weight * min(overlap, 2) + o.recent_view_weight * shares
                main = overlap >= 1
            elif o.planted == "rare_action":
                window = back[:o.long_window]
                hits = [i for i, ev in enumerate(window) if ev["adv"] == adv and ev["act"] >= 1]
                converted = any(ev["cat"] == cat and ev["act"] == 2 for ev in window)
                viewed = any(ev["cat"] == cat for ev in recent)
                main = bool(hits)
                where = hits[0] if hits else None
                terms = (o.recent_advertiser_weight * main + o.recent_category_weight * converted
                         + o.recent_view_weight * viewed)
            elif o.planted == "hierarchy":
                family = any(parent[ev["cat"]] == parent[cat] and ev["act"] >= 1
                             for ev in recent)
                same = any(ev["cat"] == cat and ev["act"] >= 1 for ev in recent)
                terms = o.parent_weight * family + 0.5 * same
                main = family
            elif o.planted == "cross":
                world = generator.planted_world
                main = (int(world.context_bit[context]) + int(world.category_bit[cat])
                        + (dense[2] > 0)) % 2 == 1
                engaged_same = any(ev["cat"] == cat and ev["act"] >= 1 for ev in recent)
                terms = o.cross_weight * main + o.recent_category_weight * engaged_same
            else:  # order
                engaged = next((i for i, ev in enumerate(back)
                                if ev["cat"] == cat and ev["act"] >= 1), None)
                viewed = next((i for i, ev in enumerate(back)
                               if ev["adv"] == adv and ev["act"] == 0), None)
                both = engaged is not None and viewed is not None
                main = both and engaged < viewed  # the engagement is the more recent
                before = both and engaged > viewed
                terms = o.order_weight * (main - before)
            click = _sigmoid(o.click_bias + terms + o.history_weight * affinity + request)
            p_click.append(click)
            p_conv.append(click * _sigmoid(o.conversion_bias + 1.5 * main + 1.0 * affinity
                                           + 0.8 * dense[1]))
            mains.append(bool(main))
            fired_at.append(where)
    return p_click, p_conv, mains, fired_at


def test_chunks_are_deterministic_and_match_the_schema(generator):
    o = generator.options
    a = generator.chunk(80, split="train", index=3)
    b = AdsLogGenerator(o, seed=0).chunk(80, split="train", index=3)
    for store_a, store_b in ((a.event_ids, b.event_ids), (a.candidate_ids, b.candidate_ids)):
        assert store_a.keys() == store_b.keys()
        for name in store_a:
            x, y = store_a[name], store_b[name]
            if o.planted == "multi_valued" and name == "topics":
                assert torch.equal(x.values, y.values) and torch.equal(x.offsets, y.offsets)
            else:
                assert torch.equal(x, y)
    assert torch.equal(a.labels["click"], b.labels["click"])
    other = generator.chunk(80, split="train", index=4)
    assert not torch.equal(a.candidate_offsets, other.candidate_offsets)
    a.validate(generator.schema)
    names = {f.name for f in generator.schema.event_features}
    assert ("topics" in names) == (o.planted == "multi_valued")
    assert generator.chunk(0, split="eval", index=0).batch_size == 0


def test_topics_are_jagged_per_event_and_candidate():
    generator = AdsLogGenerator(options("multi_valued"), seed=1)
    batch = generator.chunk(200, split="eval", index=0)
    batch.validate(generator.schema)
    assert generator.schema.table("topic").num_embeddings == 40
    feature = next(f for f in generator.schema.candidate_features if f.name == "topics")
    assert feature.multi_valued and feature.table == "topic"
    ad_topics = {}
    for ids, store in ((batch.event_ids["ad_id"], batch.event_ids),
                       (batch.candidate_ids["ad_id"], batch.candidate_ids)):
        topics = store["topics"]
        assert topics.offsets.numel() == ids.numel() + 1
        lengths = topics.lengths()
        assert int(lengths.min()) >= 1 and int(lengths.max()) <= 3
        assert int(topics.values.min()) >= 0 and int(topics.values.max()) < 40
        for i, ad in enumerate(ids.tolist()):
            mine = topics.values[int(topics.offsets[i]):int(topics.offsets[i + 1])].tolist()
            assert len(set(mine)) == len(mine)  # distinct topics
            assert ad_topics.setdefault(ad, mine) == mine  # an ad's topics are the ad's
    assert len({len(t) for t in ad_topics.values()}) == 3  # one, two and three topics


def test_true_probabilities_are_the_documented_formula(generator):
    n = 24 if generator.options.planted == "rare_action" else 60
    batch, probs = generator.chunk_with_probabilities(n, split="train", index=1)
    p_click, p_conv, mains, _ = _oracle(generator, batch)
    assert 3 <= sum(mains) <= len(mains) - 3  # both sides of the main term are checked
    # (The generator scales the float32 dense features in float32: a relative 1e-7.)
    np.testing.assert_allclose(probs["click"], p_click, rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(probs["conversion"], p_conv, rtol=1e-6, atol=1e-12)
    assert bool((batch.labels["conversion"] <= batch.labels["click"]).all())


def test_the_indicators_are_the_click_logit(generator):
    """The indicator columns with the kind's weights and the request terms give the logit."""
    o = generator.options
    chunk = generator.chunk_with_indicators(300, split="eval", index=0)
    weights = {"multi_valued": (o.topic_weight, o.topic_weight, o.recent_view_weight),
               "rare_action": (o.recent_advertiser_weight, o.recent_category_weight,
                               o.recent_view_weight),
               "hierarchy": (o.parent_weight, 0.5),
               "order": (o.order_weight, -o.order_weight),
               "cross": (o.cross_weight, o.recent_category_weight)}[o.planted] + (
                   o.history_weight,)
    assert chunk.indicators.shape == (chunk.batch.num_candidates, len(weights))
    assert len(generator.indicator_names) == len(weights)
    expected = (o.click_bias + chunk.indicators @ np.array(weights)
                + chunk.request_terms @ np.array([0.5, 0.0, 0.6, 0.3]))
    p = chunk.probabilities["click"]
    np.testing.assert_allclose(np.log(p) - np.log1p(-p), expected, atol=1e-6)


def test_the_main_indicator_fires_often_and_the_regression_nears_the_floor(generator):
    o = generator.options
    chunk = generator.chunk_with_indicators(2048, split="eval", index=0)
    share = float(chunk.indicators[:, 0].mean())
    assert 0.05 < share < 0.6, (o.planted, share)
    achievable = achievable_ne(generator, 4096)
    regression = indicator_regression_ne(generator, 4096, 4096)
    assert set(regression) == {"click", "conversion"}
    for task in regression:
        assert achievable[task] < regression[task] + 0.02, (o.planted, task)
        assert regression[task] < 1.0
    assert achievable["click"] < 0.97


def test_rare_action_fires_on_old_events():
    generator = AdsLogGenerator(options("rare_action"), seed=2)
    batch, _ = generator.chunk_with_probabilities(80, split="eval", index=0)
    engaged = batch.event_ids["action"] >= 1
    assert 0.02 < float(engaged.double().mean()) < 0.06  # engaged events are rare
    assert float(batch.seq_lengths().double().median()) > 150  # histories are long
    fired = [at for at in _oracle(generator, batch)[3] if at is not None]
    assert len(fired) > 10
    assert np.mean([at >= 32 for at in fired]) > 0.5  # most far back
    # A length the user sets is kept.
    kept = AdsLogGenerator(options("rare_action", mean_length=20.0), seed=2)
    assert float(kept.chunk(200, split="eval", index=0).seq_lengths().double().median()) < 40


def test_hierarchy_parents_are_fixed_families_and_siblings_fire():
    generator = AdsLogGenerator(options("hierarchy"), seed=0)
    parent = generator.planted_world.category_parent
    assert parent.shape == (50,) and np.bincount(parent).tolist() == [5] * 10
    assert np.array_equal(parent, AdsLogGenerator(options("hierarchy"), seed=0)
                          .planted_world.category_parent)
    chunk = generator.chunk_with_indicators(2048, split="eval", index=0)
    family, same = chunk.indicators[:, 0], chunk.indicators[:, 1]
    assert bool((same <= family).all())
    assert float((family - same).mean()) > 0.05  # a sibling category, not the same one


def test_order_is_not_presence():
    """Among candidates with both kinds of events, each order is about as common and the two
    orders' click rates differ a lot: on average the order term adds little to the logit of
    the candidates where both are present."""
    generator = AdsLogGenerator(options("order"), seed=0)
    chunk = generator.chunk_with_indicators(4096, split="eval", index=0)
    after, before = chunk.indicators[:, 0] > 0, chunk.indicators[:, 1] > 0
    assert not bool((after & before).any())
    assert after.mean() > 0.1 and before.mean() > 0.1
    p = chunk.probabilities["click"]
    assert p[after].mean() > 3 * p[before].mean()
    assert 0.35 < after.sum() / (after | before).sum() < 0.65


def test_cross_needs_all_three_features():
    """``cross``'s main term is a three-way parity: the click rate by any pair of its three
    bits is flat (within sampling noise), by all three it moves by about the term's weight."""
    generator = AdsLogGenerator(options("cross"), seed=3)
    world = generator.planted_world
    assert sorted(np.bincount(world.context_bit).tolist()) == [8, 8]
    assert np.bincount(world.category_bit).tolist() == [25, 25]
    chunks = [generator.chunk_with_indicators(4096, split="eval", index=i) for i in range(3)]
    bits, p = [], []
    for chunk in chunks:
        batch = chunk.batch
        owner = torch.repeat_interleave(torch.arange(batch.batch_size),
                                        batch.candidate_offsets.diff()).numpy()
        bits.append(np.stack([world.context_bit[batch.sparse["context"].values.numpy()[owner]],
                              world.category_bit[batch.candidate_ids["category"].numpy()],
                              batch.dense[:, 2].numpy()[owner] > 0], axis=1).astype(int))
        p.append(chunk.probabilities["click"])
        assert np.array_equal(chunk.indicators[:, 0], bits[-1].sum(axis=1) % 2)
    bits, p = np.concatenate(bits), np.concatenate(p)
    logit = np.log(p) - np.log1p(-p)
    for a, b in ((0, 1), (0, 2), (1, 2)):
        # the mean click logit in each cell of a pair of bits: the same in all four
        cells = [logit[(bits[:, a] == x) & (bits[:, b] == y)].mean()
                 for x in (0, 1) for y in (0, 1)]
        assert max(cells) - min(cells) < 0.3, ((a, b), cells)
    odd = bits.sum(axis=1) % 2 == 1
    assert logit[odd].mean() - logit[~odd].mean() > 0.8 * generator.options.cross_weight
    with pytest.raises(ValueError, match="dense\\[2\\]"):
        SynthOptions(planted="cross", num_dense=2)


def _digest(batch, probs) -> str:
    h = hashlib.sha256()
    parts = [batch.seq_offsets, batch.seq_timestamps, batch.request_timestamps,
             batch.candidate_offsets, batch.user_ids]
    for store in (batch.event_ids, batch.candidate_ids, batch.labels):
        parts += [store[name] for name in sorted(store)]
    for name in sorted(batch.sparse):
        parts += [batch.sparse[name].values, batch.sparse[name].offsets]
    parts += [torch.from_numpy(np.round(probs[task], 10)) for task in sorted(probs)]
    for part in parts:
        h.update(part.contiguous().numpy().tobytes())
    return h.hexdigest()[:20]


def test_ads_is_the_data_of_before():
    """``planted="ads"`` (the default) draws what the generator drew before the kinds existed:
    digests taken from the generator of then."""
    o = SynthOptions(num_items=500, num_users=80, max_length=48, seq_dense_dim=2)
    assert o == attrs.evolve(o, planted="ads") and o.median_length == 60.0
    generator = AdsLogGenerator(o, seed=11)
    assert generator.indicator_names == ("recent_advertiser", "recent_category", "recent_view",
                                         "affinity")
    digests = [_digest(*generator.chunk_with_probabilities(64, split=split, index=index))
               for split, index in (("train", 2), ("eval", 1))]
    assert digests == ["5f837049d416322edd5a", "ef0b825b9a468aad0abe"]
    regression = indicator_regression_ne(generator, 4096, 2048)
    achievable = achievable_ne(generator, 2048)
    # The hand-made indicators alone miss the request-level terms the process also has.
    assert achievable["click"] < regression["click"] < 1.0


def test_fit_logistic_recovers_weights():
    rng = np.random.default_rng(0)
    x = np.hstack([np.ones((20000, 1)), rng.standard_normal((20000, 2))])
    truth = np.array([-1.0, 0.8, -0.5])
    y = (rng.random(20000) < 1 / (1 + np.exp(-x @ truth))).astype(np.float64)
    np.testing.assert_allclose(fit_logistic(x, y), truth, atol=0.08)


def test_the_source_and_synth_record_the_indicator_ne(tmp_path):
    from gem_core.plugins import build_plugins
    from gem_data.manifest import read_manifest
    from gem_data.synth import synthesize

    small = dict(num_items=400, num_users=100, planted="multi_valued")
    config = DataConfig(source="synthetic-ads", max_seq_len=32, eval_rows=300, options=small)
    report = build_plugins().data_source(config, seed=1).report()
    assert set(report["indicator_ne"]) == set(report["achievable_ne"]) == {"click",
                                                                          "conversion"}
    assert set(report["achievable_auc"]) == set(report["achievable_gauc"]) == {"click",
                                                                              "conversion"}
    options = SynthOptions(max_length=32, **small)
    synthesize(tmp_path / "ds", rows=200, seed=1, eval_rows=300, options=options,
               row_group_rows=128)
    info = read_manifest(tmp_path / "ds").info
    assert info["indicator_ne"] == pytest.approx(report["indicator_ne"])
    for metric in ("ne", "auc", "gauc"):
        assert info[f"achievable_{metric}"] == pytest.approx(report[f"achievable_{metric}"])
    assert info["options"]["planted"] == "multi_valued"
