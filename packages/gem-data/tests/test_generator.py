"""The synthetic-ads generator: request-level rows, hashed ids, Zipf candidates, a planted label
that the docstring's formula recomputes from the batch's attributes, and the achievable NE."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gem_core.metrics import normalized_entropy
from gem_data.generator import (
    AdsLogGenerator,
    achievable_figures,
    achievable_ne,
    normalized_entropy_of_probabilities,
    truncated_zipf_pmf,
)
from gem_data.synth_options import SynthOptions

OPTIONS = SynthOptions(num_items=400, num_users=100, num_clusters=8, num_advertisers=30,
                       mean_length=20.0, max_length=64)


@pytest.fixture(scope="module")
def generator():
    return AdsLogGenerator(OPTIONS, seed=3)


def test_rows_are_a_pure_function_of_seed_split_index(generator):
    a = generator.chunk(50, split="train", index=4)
    b = AdsLogGenerator(OPTIONS, seed=3).chunk(50, split="train", index=4)
    c = generator.chunk(50, split="train", index=5)
    d = generator.chunk(50, split="eval", index=4)
    assert torch.equal(a.event_ids["ad_id"], b.event_ids["ad_id"])
    assert torch.equal(a.candidate_offsets, b.candidate_offsets)
    assert torch.equal(a.labels["click"], b.labels["click"])
    assert not torch.equal(a.candidate_offsets, c.candidate_offsets)
    assert not torch.equal(a.candidate_offsets, d.candidate_offsets)
    a.validate(generator.schema)


def test_shape_of_the_data(generator):
    batch = generator.chunk(3000, split="train", index=0)
    batch.validate(generator.schema)
    schema = generator.schema
    assert schema.table("ad").id_policy == "hash"
    assert schema.table("ad").num_embeddings == 2 * OPTIONS.num_items
    # 64-bit hashed ids: spread over the whole int64 range, both signs.
    ids = batch.candidate_ids["ad_id"]
    assert int(ids.min()) < -(1 << 60) and int(ids.max()) > (1 << 60)
    assert torch.unique(batch.event_ids["ad_id"]).numel() <= OPTIONS.num_items
    # Each ad has one advertiser and one category, events and candidates alike.
    ad_to_attrs = {}
    for store in (batch.event_ids, batch.candidate_ids):
        for ad, adv, cat in zip(store["ad_id"].tolist(), store["advertiser"].tolist(),
                                store["category"].tolist()):
            assert ad_to_attrs.setdefault(ad, (adv, cat)) == (adv, cat)
    # Candidates per request: truncated Zipf, 1..32, mean about 4.4.
    counts = batch.candidate_counts()
    assert int(counts.min()) >= 1 and int(counts.max()) <= 32
    pmf = truncated_zipf_pmf(1.5, 32)
    expected_mean = float((np.arange(1, 33) * pmf).sum())
    assert abs(float(counts.double().mean()) - expected_mean) < 0.4
    assert 4.0 < expected_mean < 4.8
    # Histories strictly before their request, oldest first.
    rows = torch.repeat_interleave(torch.arange(batch.batch_size), batch.seq_lengths())
    assert bool((batch.seq_timestamps < batch.request_timestamps[rows]).all())
    assert batch.user_ids.shape == (batch.batch_size,)
    one = AdsLogGenerator(SynthOptions(num_items=100, max_candidates=1), seed=0)
    assert int(one.chunk(20, split="train", index=0).candidate_counts().max()) == 1


def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def test_planted_label_is_the_documented_formula_of_attributes(generator):
    """Recompute P(click) and P(conversion) of every impression from the batch's attributes
    (never its ad ids) with the module docstring's formula."""
    o = OPTIONS
    batch, probs = generator.chunk_with_probabilities(60, split="train", index=1)
    ev, cand = batch.event_ids, batch.candidate_ids
    for r in range(batch.batch_size):
        s, e = int(batch.seq_offsets[r]), int(batch.seq_offsets[r + 1])
        adv, cat, act = (ev["advertiser"][s:e].tolist(), ev["category"][s:e].tolist(),
                         ev["action"][s:e].tolist())
        recent = list(zip(adv, cat, act))[-o.recent_window:]
        weights = [math.exp(-(e - s - 1 - i) / 64.0) * (1.0, 3.0, 6.0)[a]
                   for i, a in enumerate(act)]
        segment = int(batch.sparse["user_segment"].values[
            int(batch.sparse["user_segment"].offsets[r])])
        context = int(batch.sparse["context"].values[r])
        dense = batch.dense[r].double().tolist()
        for c in range(int(batch.candidate_offsets[r]), int(batch.candidate_offsets[r + 1])):
            c_adv, c_cat = int(cand["advertiser"][c]), int(cand["category"][c])
            adv_match = any(a == c_adv and x >= 1 for a, _, x in recent)
            cat_match = any(k == c_cat and x >= 1 for _, k, x in recent)
            viewed = any(k == c_cat for _, k, _ in recent)
            total = sum(weights)
            affinity = (sum(w for w, k in zip(weights, cat) if k == c_cat) / total
                        if total else 0.0)
            logit = (o.click_bias + o.recent_advertiser_weight * adv_match
                     + o.recent_category_weight * cat_match + o.recent_view_weight * viewed
                     + o.history_weight * affinity + 0.5 * dense[0]
                     + 0.6 * (segment % 4 == 0) + 0.3 * (context == 3))
            p_click = _sigmoid(logit)
            p_conv = _sigmoid(o.conversion_bias + 1.5 * adv_match + 1.0 * affinity
                              + 0.8 * dense[1])
            assert probs["click"][c] == pytest.approx(p_click, rel=1e-4, abs=1e-7)
            assert probs["conversion"][c] == pytest.approx(p_click * p_conv, rel=1e-4,
                                                           abs=1e-7)
    # Conversions only among clicks.
    assert bool((batch.labels["conversion"] <= batch.labels["click"]).all())


def test_true_probabilities_are_calibrated_and_informative(generator):
    batch, probs = generator.chunk_with_probabilities(4000, split="eval", index=0)
    for task in ("click", "conversion"):
        labels = batch.labels[task].double()
        assert float(labels.mean()) == pytest.approx(probs[task].mean(), rel=0.15)
        ne = normalized_entropy_of_probabilities(probs[task], labels.numpy())
        # The same number as the trainer's metric (which takes logits).
        p = torch.from_numpy(probs[task])
        assert ne == pytest.approx(normalized_entropy(torch.logit(p), labels), rel=1e-9)
        assert ne < 0.95
    # The recent-history terms matter: among candidates, the click rate differs a lot.
    hi = probs["click"] > np.quantile(probs["click"], 0.9)
    assert batch.labels["click"].numpy()[hi].mean() > 3 * batch.labels["click"].numpy().mean()


def test_achievable_ne_on_the_eval_split(generator):
    values = achievable_ne(generator, 5000)  # two eval chunks (4096 + 904)
    assert set(values) == {"click", "conversion"}
    assert all(0.3 < v < 1.0 for v in values.values())
    assert values == achievable_ne(AdsLogGenerator(OPTIONS, seed=3), 5000)
    assert [size for _, size in generator.eval_chunks(5000)] == [4096, 904]


def _loop_gauc(scores: np.ndarray, labels: np.ndarray, users: np.ndarray) -> float:
    """GAUC by a loop over users and over every pair of a user's impressions (ties count 1/2),
    each user weighted by their impressions: the reference the figures are checked against."""
    total = weight = 0.0
    for user in np.unique(users):
        s, y = scores[users == user], labels[users == user]
        pos, neg = s[y == 1], s[y == 0]
        if pos.size and neg.size:
            wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
            total += y.size * wins / (pos.size * neg.size)
            weight += y.size
    return total / weight


def test_achievable_ranking_is_that_of_the_true_probabilities_by_user(generator):
    """The true probabilities' AUC and GAUC (users as a run's evaluation groups them: each
    impression's request user), against a loop over every pair; better than any score that
    knows less, such as the probabilities with noise."""
    figures = achievable_figures(generator, 5000)
    assert {task: f["ne"] for task, f in figures.items()} == achievable_ne(generator, 5000)
    probs, labels, users = {t: [] for t in figures}, {t: [] for t in figures}, []
    for index, size in generator.eval_chunks(5000):
        batch, p = generator.chunk_with_probabilities(size, split="eval", index=index)
        users.append(batch.user_ids[batch.candidate_rows()].numpy())
        for task in figures:
            probs[task].append(p[task])
            labels[task].append(batch.labels[task].numpy())
    users = np.concatenate(users)
    assert np.unique(users).size > 50  # many users, most with several impressions
    rng = np.random.default_rng(0)
    for task, f in figures.items():
        p, y = np.concatenate(probs[task]), np.concatenate(labels[task])
        assert f["gauc"] == pytest.approx(_loop_gauc(p, y, users), abs=1e-12)
        assert f["auc"] == pytest.approx(_loop_gauc(p, y, np.zeros_like(users)), abs=1e-12)
        noisy = p * np.exp(rng.normal(0.0, 1.0, p.size))
        assert _loop_gauc(noisy, y, users) < f["gauc"] and 0.55 < f["gauc"] < 1.0
