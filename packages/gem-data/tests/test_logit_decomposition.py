"""``gem_data.logit_decomposition``: slopes read back from logits built of known parts, in
float64, and bad input refused with what is wrong."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gem_data.logit_decomposition import DecompositionError, decompose_logits, logits_of


def test_slopes_and_the_residual_are_those_the_logits_were_built_with():
    rng = np.random.default_rng(5)
    n = 200_000
    user, ad = rng.normal(0, 0.5, n), rng.normal(0, 0.5, n)
    engaged = (rng.random(n) < 0.4).astype(np.float64)
    noise = rng.normal(0, 0.3, n)
    logits = -4.0 + 0.5 * user + 1.2 * ad + 1.5 * engaged + noise
    fit = decompose_logits(logits, {"user": user, "ad": ad, "engaged": engaged})
    assert list(fit.slopes) == ["user", "ad", "engaged"]
    assert fit.slopes["user"] == pytest.approx(0.5, abs=0.01)
    assert fit.slopes["ad"] == pytest.approx(1.2, abs=0.01)
    assert fit.slopes["engaged"] == pytest.approx(1.5, abs=0.01)
    assert fit.intercept == pytest.approx(-4.0, abs=0.01)
    assert fit.residual_sd == pytest.approx(0.3, abs=0.005)
    explained = np.var(0.5 * user + 1.2 * ad + 1.5 * engaged)
    assert fit.r_squared == pytest.approx(explained / (explained + 0.09), abs=0.005)


def test_logits_that_are_exactly_the_parts_leave_no_residual():
    parts = {"a": np.array([0.1, -0.4, 0.7, 0.2]), "b": np.array([1.0, 0.0, 0.0, 1.0])}
    fit = decompose_logits(2.0 * parts["a"] - 0.5 * parts["b"] + 0.25, parts)
    assert fit.slopes == pytest.approx({"a": 2.0, "b": -0.5}, abs=1e-12)
    assert fit.residual_sd < 1e-12 and fit.r_squared == pytest.approx(1.0)


def test_constant_logits_carry_no_part_and_explain_nothing():
    parts = {"a": np.array([0.1, -0.4, 0.7, 0.2])}
    fit = decompose_logits(np.full(4, -3.0), parts)
    assert fit.slopes["a"] == pytest.approx(0.0, abs=1e-12)
    assert fit.intercept == pytest.approx(-3.0) and fit.r_squared == 0.0


@pytest.mark.parametrize("logits, parts, message", [
    (np.zeros(3), {"a": np.ones(4)}, r"part 'a' has shape \(4,\), the logits \(3,\)"),
    (np.array([0.0, math.nan, 1.0]), {"a": np.array([1.0, 2.0, 4.0])}, "logit at row 1 is nan"),
    (np.zeros(3), {"a": np.array([1.0, math.inf, 0.0])}, "part 'a' is inf at row 1"),
    (np.array([0.0, 1.0, 3.0]), {"a": np.full(3, 2.0)}, r"linearly dependent.*rank 1 of 2"),
    (np.array([0.0, 1.0, 3.0, 2.0]),
     {"a": np.array([1.0, 0.0, 1.0, 0.0]), "b": np.array([0.0, 1.0, 0.0, 1.0])},
     r"\['a', 'b'\] and an intercept are linearly dependent"),
    (np.zeros(2), {}, "no parts"),
    (np.zeros((2, 2)), {"a": np.zeros((2, 2))}, "one value per row"),
])
def test_bad_input_is_refused_saying_what_is_wrong(logits, parts, message):
    with pytest.raises(DecompositionError, match=message):
        decompose_logits(logits, parts)


def test_logits_of_inverts_the_sigmoid_and_keeps_certain_scores_finite():
    z = np.array([-6.0, -0.3, 0.0, 2.5])
    np.testing.assert_allclose(logits_of(1 / (1 + np.exp(-z))), z, rtol=1e-9, atol=1e-12)
    ends = logits_of(np.array([0.0, 1.0]))
    assert np.isfinite(ends).all() and ends[0] < -15 and ends[1] > 15
