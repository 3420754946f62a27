"""GAUC (impression-weighted per-user AUC) against a plain per-user loop with pairwise counting."""

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gem_core.metrics import grouped_auc, roc_auc, task_report


def _reference_gauc(scores, labels, groups):
    """Independent float64 reference: a Python loop over users, every (positive, negative) pair
    counted (1 if the positive scores higher, 1/2 on a tie), users weighted by impressions."""
    users: dict[int, list[tuple[float, int]]] = {}
    for s, y, g in zip(scores, labels, groups):
        users.setdefault(int(g), []).append((float(s), int(y)))
    weighted, weights, counted, excluded, excluded_imps = [], [], 0, 0, 0
    for rows in users.values():
        pos = [s for s, y in rows if y == 1]
        neg = [s for s, y in rows if y == 0]
        if not pos or not neg:
            excluded += 1
            excluded_imps += len(rows)
            continue
        wins = math.fsum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
        weighted.append(len(rows) * wins / (len(pos) * len(neg)))
        weights.append(len(rows))
        counted += 1
    gauc = math.fsum(weighted) / sum(weights) if weights else math.nan
    return {"gauc": gauc, "gauc_users": counted, "gauc_impressions": sum(weights),
            "gauc_excluded_users": excluded, "gauc_excluded_impressions": excluded_imps}


def _check(scores, labels, groups):
    got = grouped_auc(torch.tensor(scores, dtype=torch.float64),
                      torch.tensor(labels, dtype=torch.float32),
                      torch.tensor(groups, dtype=torch.int64))
    want = _reference_gauc(scores, labels, groups)
    assert set(got) == set(want)
    for key in want:
        if key == "gauc":
            if math.isnan(want[key]):
                assert math.isnan(got[key])
            else:
                assert got[key] == pytest.approx(want[key], rel=1e-12, abs=1e-12), (got, want)
        else:
            assert got[key] == want[key], (key, got, want)
    return got


# Few distinct scores and few users: many ties inside a user, many single-class users.
_tied_rows = st.lists(st.tuples(st.integers(-2, 2), st.integers(0, 1), st.integers(-3, 5)),
                      min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(rows=_tied_rows)
def test_gauc_matches_loop_with_ties_and_single_class_users(rows):
    scores = [0.25 * s for s, _, _ in rows]
    labels = [y for _, y, _ in rows]
    groups = [g for _, _, g in rows]
    _check(scores, labels, groups)


@settings(max_examples=80, deadline=None)
@given(n=st.integers(2, 500), users=st.integers(1, 60), rate=st.floats(0.05, 0.95),
       levels=st.sampled_from([0, 3, 20]), seed=st.integers(0, 2**31 - 1))
def test_gauc_matches_loop_on_random_data(n, users, rate, levels, seed):
    """Random scores (continuous, or quantised to a few levels for ties), random user keys
    spread over a wide int64 range, labels correlated with the score."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randint(-2**40, 2**40, (users,), generator=gen)
    groups = keys[torch.randint(0, users, (n,), generator=gen)]
    labels = (torch.rand(n, generator=gen) < rate).long()
    scores = torch.randn(n, generator=gen, dtype=torch.float64) + 0.7 * labels
    if levels:
        scores = torch.round(scores * levels / 4)
    got = _check(scores.tolist(), labels.tolist(), groups.tolist())
    assert got["gauc_users"] + got["gauc_excluded_users"] == len(set(groups.tolist()))
    assert got["gauc_impressions"] + got["gauc_excluded_impressions"] == n


@settings(max_examples=60, deadline=None)
@given(data=st.lists(st.tuples(st.integers(-3, 3), st.booleans()), min_size=1, max_size=40),
       key=st.integers(-2**62, 2**62))
def test_single_group_equals_roc_auc(data, key):
    scores = torch.tensor([float(s) for s, _ in data])
    labels = torch.tensor([float(y) for _, y in data])
    got = grouped_auc(scores, labels, torch.full((len(data),), key, dtype=torch.int64))
    want = roc_auc(scores, labels)
    if math.isnan(want):
        assert math.isnan(got["gauc"])
        assert (got["gauc_users"], got["gauc_excluded_users"]) == (0, 1)
        assert got["gauc_excluded_impressions"] == len(data)
    else:
        assert got["gauc"] == pytest.approx(want, abs=1e-12)
        assert (got["gauc_users"], got["gauc_excluded_users"]) == (1, 0)
        assert got["gauc_impressions"] == len(data)


@settings(max_examples=40, deadline=None)
@given(rows=_tied_rows, seed=st.integers(0, 2**31 - 1))
def test_gauc_ignores_row_order_and_key_values(rows, seed):
    scores = torch.tensor([0.25 * s for s, _, _ in rows], dtype=torch.float64)
    labels = torch.tensor([y for _, y, _ in rows], dtype=torch.float32)
    groups = torch.tensor([g for _, _, g in rows], dtype=torch.int64)
    base = grouped_auc(scores, labels, groups)
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))
    remapped = groups * 1_000_003 - 7  # injective relabelling of the user keys
    moved = grouped_auc(scores[perm], labels[perm], remapped[perm])
    for key in base:
        if isinstance(base[key], float) and math.isnan(base[key]):
            assert math.isnan(moved[key])
        else:
            assert moved[key] == pytest.approx(base[key], abs=1e-12)


def test_hand_computed_example():
    # user 7: scores .1(-) .2(+) .2(-) .5(+): pairs 1 + 1/2 + 1 + 1 -> AUC 3.5/4, 4 impressions
    # user 3: .3(+) .3(-): AUC 1/2, 2 impressions;  user 9: only positives -> excluded
    scores = torch.tensor([0.1, 0.3, 0.2, 0.9, 0.2, 0.5, 0.3, 0.8])
    labels = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    groups = torch.tensor([7, 3, 7, 9, 7, 7, 3, 9])
    got = grouped_auc(scores, labels, groups)
    assert got == {"gauc": pytest.approx((4 * 0.875 + 2 * 0.5) / 6), "gauc_users": 2,
                   "gauc_impressions": 6, "gauc_excluded_users": 1,
                   "gauc_excluded_impressions": 2}


def test_no_qualifying_user_gives_nan_and_counts():
    got = grouped_auc(torch.tensor([0.3, 0.1, 0.7]), torch.tensor([1.0, 0.0, 0.0]),
                      torch.tensor([1, 2, 2]))
    assert math.isnan(got["gauc"])
    assert (got["gauc_users"], got["gauc_excluded_users"]) == (0, 2)
    assert (got["gauc_impressions"], got["gauc_excluded_impressions"]) == (0, 3)
    empty = grouped_auc(torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.int64))
    assert math.isnan(empty["gauc"]) and empty["gauc_users"] == empty["gauc_excluded_users"] == 0


def test_all_tied_user_counts_one_half():
    # Both classes, one score: every pair is a tie -> 1/2 (TorchRec instead skips such users).
    got = grouped_auc(torch.tensor([0.4, 0.4, 0.4, 0.9, 0.1]), torch.tensor([1.0, 0, 0, 1, 0]),
                      torch.tensor([5, 5, 5, 6, 6]))
    assert got["gauc"] == pytest.approx((3 * 0.5 + 2 * 1.0) / 5)


def test_input_checks():
    with pytest.raises(ValueError, match="size"):
        grouped_auc(torch.zeros(3), torch.zeros(3), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="integer"):
        grouped_auc(torch.zeros(3), torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match="0/1"):
        grouped_auc(torch.zeros(3), torch.tensor([0.0, 0.5, 1.0]),
                    torch.zeros(3, dtype=torch.int64))


def test_task_report_adds_gauc_only_with_groups():
    rng = random.Random(0)
    logits = torch.tensor([rng.gauss(0, 1) for _ in range(200)])
    labels = (torch.rand(200, generator=torch.Generator().manual_seed(1)) < 0.4).float()
    groups = torch.randint(0, 20, (200,), generator=torch.Generator().manual_seed(2))
    plain = task_report(logits, labels)
    assert not any(key.startswith("gauc") for key in plain)
    with_groups = task_report(logits, labels, groups)
    assert {k: v for k, v in with_groups.items() if not k.startswith("gauc")} == plain
    assert with_groups["gauc"] == grouped_auc(logits, labels, groups)["gauc"]
    assert with_groups["gauc"] == pytest.approx(
        _reference_gauc(logits.tolist(), labels.tolist(), groups.tolist())["gauc"], abs=1e-12)


def test_vectorised_scale():
    """100k impressions over 10k users: checked against the loop on a subsample of users."""
    gen = torch.Generator().manual_seed(3)
    n, users = 100_000, 10_000
    groups = torch.randint(0, users, (n,), generator=gen)
    labels = (torch.rand(n, generator=gen) < 0.2).float()
    scores = torch.round((torch.randn(n, generator=gen) + labels) * 8) / 8  # ties
    got = grouped_auc(scores, labels, groups)
    assert got["gauc_impressions"] + got["gauc_excluded_impressions"] == n
    assert got["gauc_users"] + got["gauc_excluded_users"] == len(torch.unique(groups))
    keep = groups < 300
    sub = grouped_auc(scores[keep], labels[keep], groups[keep])
    want = _reference_gauc(scores[keep].tolist(), labels[keep].tolist(), groups[keep].tolist())
    assert sub["gauc"] == pytest.approx(want["gauc"], abs=1e-12)
    assert 0.6 < got["gauc"] < 0.8
