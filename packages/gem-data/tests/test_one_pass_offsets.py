"""``gem_data.one_pass_offsets``: per-id offsets learnt in one pass, checked step by step against
float64 arithmetic written out here."""

import math

import numpy as np
import pytest

from gem_data.one_pass_offsets import one_pass_offsets, summed_offsets


def _by_hand(base, ids, labels, rate, fisher):
    tables = [{} for _ in ids]
    seen = [{} for _ in ids]
    for row, label in enumerate(labels):
        keys = [column[row] for column in ids]
        logit = base[row] + sum(t.get(k, 0.0) for t, k in zip(tables, keys))
        residual = label - 1 / (1 + math.exp(-logit))
        for table, summed, key in zip(tables, seen, keys):
            if fisher:
                summed[key] = summed.get(key, 0.0) + residual ** 2
                table[key] = table.get(key, 0.0) + residual / (1 / rate + summed[key])
            else:
                table[key] = table.get(key, 0.0) + rate * residual
    return tables


@pytest.mark.parametrize("step", ["fisher", "constant"])
def test_each_impression_moves_its_ids_offsets_in_order(step):
    rng = np.random.default_rng(3)
    rows = 200
    base = rng.normal(-2.0, 0.5, rows)
    users, items = rng.integers(0, 7, rows), rng.integers(100, 140, rows)
    labels = (rng.random(rows) < 0.3).astype(np.float64)
    got = one_pass_offsets(base, [users, items], labels, rate=0.25, step=step)
    want = _by_hand(base, [users, items], labels, 0.25, step == "fisher")
    for table, expected in zip(got, want):
        assert table.keys() == expected.keys()
        for key, value in expected.items():
            assert table[key] == pytest.approx(value, rel=1e-12, abs=1e-15)
    # the users (about 29 impressions each) moved well away from 0
    assert max(abs(v) for v in got[0].values()) > 0.1
    # an unseen id adds nothing; a seen one its offset
    total = summed_offsets(got, [np.array([3, 99]), np.array([items[0], 1000])])
    assert total.tolist() == pytest.approx([got[0][3] + got[1][items[0]], 0.0])


def test_fisher_steps_shrink_as_an_id_is_seen():
    """A frequent id settles: under ``fisher`` its later steps are smaller than ``constant``'s
    at the same rate; its first step is the same."""
    labels = np.array([1.0, 0.0] * 50)
    base, ids = np.zeros(100), [np.zeros(100, dtype=np.int64)]
    first_fisher = one_pass_offsets(base[:1], [ids[0][:1]], labels[:1], rate=0.25)[0][0]
    first_constant = one_pass_offsets(base[:1], [ids[0][:1]], labels[:1], rate=0.25,
                                      step="constant")[0][0]
    # F includes this impression's own squared residual: 0.5 / (4 + 0.25)
    assert first_fisher == pytest.approx(0.5 / 4.25) and first_constant == pytest.approx(0.125)
    fisher = one_pass_offsets(base, ids, labels, rate=0.25)[0][0]
    constant = one_pass_offsets(base, ids, labels, rate=0.25, step="constant")[0][0]
    # alternating labels: the true effect is 0; fisher ends nearer to it
    assert abs(fisher) < abs(constant)


def test_a_learned_prior_is_reestimated_every_step_from_the_ids_seen():
    """``prior = "learned"``: every ``every`` rows each column's prior variance becomes the mean
    over its ids seen so far of ``b^2 + 1 / (1 / prior + F)``; checked against the same
    arithmetic written out here, and on ids whose effects vary far more than the starting rate
    the prior grows."""
    rng = np.random.default_rng(5)
    rows, every = 3000, 100
    items = rng.integers(0, 30, rows)
    effects = rng.normal(0.0, 1.5, 30)  # variance 2.25, against a starting rate of 0.1
    labels = (rng.random(rows) < 1 / (1 + np.exp(-effects[items]))).astype(np.float64)
    got = one_pass_offsets(np.zeros(rows), [items], labels, rate=0.1, prior="learned",
                           every=every)[0]
    table, seen, prior = {}, {}, 0.1
    for row in range(rows):
        key = items[row]
        residual = labels[row] - 1 / (1 + math.exp(-table.get(key, 0.0)))
        seen[key] = seen.get(key, 0.0) + residual ** 2
        table[key] = table.get(key, 0.0) + residual / (1 / prior + seen[key])
        if (row + 1) % every == 0:
            prior = sum(table[k] ** 2 + 1 / (1 / prior + seen[k]) for k in table) / len(table)
    assert got.keys() == table.keys()
    assert [got[k] for k in table] == pytest.approx([table[k] for k in table], rel=1e-9)
    assert prior > 1.0
    fixed = one_pass_offsets(np.zeros(rows), [items], labels, rate=0.1)[0]
    # the learned prior lets the offsets reach the effects a fixed small prior holds back
    learned_error = np.mean((np.array([got[k] for k in range(30)]) - effects) ** 2)
    fixed_error = np.mean((np.array([fixed[k] for k in range(30)]) - effects) ** 2)
    assert learned_error < 0.5 * fixed_error


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="step 'adam'"):
        one_pass_offsets(np.zeros(2), [np.zeros(2)], np.zeros(2), rate=0.1, step="adam")
    with pytest.raises(ValueError, match="learned one needs the fisher"):
        one_pass_offsets(np.zeros(2), [np.zeros(2)], np.zeros(2), rate=0.1, step="constant",
                         prior="learned")
    with pytest.raises(ValueError, match="every"):
        one_pass_offsets(np.zeros(2), [np.zeros(2)], np.zeros(2), rate=0.1, every=0)
    with pytest.raises(ValueError, match="positive"):
        one_pass_offsets(np.zeros(2), [np.zeros(2)], np.zeros(2), rate=0.0)
    with pytest.raises(ValueError, match="rows"):
        one_pass_offsets(np.zeros(2), [np.zeros(3)], np.zeros(2), rate=0.1)
    with pytest.raises(ValueError, match="offset tables"):
        summed_offsets([{}], [np.zeros(2), np.zeros(2)])
