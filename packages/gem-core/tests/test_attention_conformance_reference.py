"""The reference backend passes the conformance suite it is the oracle of (a sanity check of both:
the suite's float64 comparison must accept the reference run in float32 and bfloat16)."""

import attrs
import pytest
import torch

from gem_core.attention.api import AttentionParams
from gem_core.attention.reference import ReferenceAttention
from gem_core.attention.relative_bias import RelativeBias
from gem_core.testing import AttentionCase, AttentionConformance
from gem_core.testing.attention_conformance import BiasSpec


class TestReferenceConformance(AttentionConformance):
    registered_as = "reference"
    dtypes = (torch.float32, torch.bfloat16)
    max_examples = 15

    def make_backend(self):
        return ReferenceAttention()


class _OffByOneWindow(ReferenceAttention):
    """A plausible kernel bug: the window boundary is exclusive instead of inclusive."""

    def __call__(self, q, k, v, q_offsets, kv_offsets, *, params, **kwargs):
        if params.window:
            params = attrs.evolve(params, window=params.window - 1)
        return super().__call__(q, k, v, q_offsets, kv_offsets, params=params, **kwargs)


class _IgnoresTargets(ReferenceAttention):
    def __call__(self, q, k, v, q_offsets, kv_offsets, *, params, num_targets=None, **kwargs):
        return super().__call__(q, k, v, q_offsets, kv_offsets, params=params, **kwargs)


class _DetachedKeys(ReferenceAttention):
    """Right forward, but no gradient reaches k."""

    def __call__(self, q, k, v, *args, **kwargs):
        return super().__call__(q, k.detach(), v, *args, **kwargs)


@pytest.mark.parametrize("broken", [_OffByOneWindow, _IgnoresTargets, _DetachedKeys])
def test_the_suite_catches_broken_backends(broken):
    suite = TestReferenceConformance()
    suite.make_backend = broken
    case = AttentionCase(
        shape="self", q_lengths=(9, 0, 12), kv_lengths=(9, 0, 12),
        params=AttentionParams(causal=True, window=3, num_prefix=1), num_targets=(2, 0, 3),
        heads=2, head_dim=16, dtype=torch.float32, seed=11,
    )
    with pytest.raises(AssertionError):
        suite.check_case(case)
    TestReferenceConformance().check_case(case)  # the same case passes with the real reference


class _IgnoresTimeBias(ReferenceAttention):
    def __call__(self, *args, bias=None, **kwargs):
        if bias is not None:
            bias = RelativeBias(position_weights=bias.position_weights)
        return super().__call__(*args, bias=bias, **kwargs)


class _DetachedPositionWeights(ReferenceAttention):
    """Right forward, but no gradient reaches the position weights."""

    def __call__(self, *args, bias=None, **kwargs):
        bias = attrs.evolve(bias, position_weights=bias.position_weights.detach())
        return super().__call__(*args, bias=bias, **kwargs)


class _SignedDistance(ReferenceAttention):
    """A plausible bucketing bug: the weights of the next bucket (as if the distance were
    counted from 1): forward and gradients both move."""

    def __call__(self, *args, bias=None, **kwargs):
        weights = torch.roll(bias.position_weights, -1, dims=1)
        return super().__call__(*args, bias=attrs.evolve(bias, position_weights=weights),
                                **kwargs)


class _RefusesBias(ReferenceAttention):
    capabilities = frozenset()

    def __call__(self, *args, bias=None, **kwargs):
        return super().__call__(*args, **kwargs)  # silently ignores the bias


@pytest.mark.parametrize("broken", [_IgnoresTimeBias, _DetachedPositionWeights, _SignedDistance])
@pytest.mark.parametrize("normalization", ["softmax", "silu"])
def test_the_suite_catches_broken_relative_bias(broken, normalization):
    suite = TestReferenceConformance()
    suite.make_backend = broken
    case = AttentionCase(
        shape="self", q_lengths=(9, 0, 1, 12), kv_lengths=(9, 0, 1, 12),
        params=AttentionParams(causal=True, window=5, normalization=normalization),
        num_targets=(2, 0, 0, 3), heads=2, head_dim=16, dtype=torch.float32, seed=4,
        bias=BiasSpec(num_position_buckets=6, num_time_buckets=10),
    )
    with pytest.raises(AssertionError):
        suite.check_case(case)
    TestReferenceConformance().check_case(case)


def test_a_backend_that_drops_an_undeclared_bias_fails_the_suite():
    suite = TestReferenceConformance()
    suite.make_backend = _RefusesBias
    with pytest.raises(pytest.fail.Exception):  # DID NOT RAISE
        suite.test_undeclared_relative_bias_raises_naming_it()


def test_bucket_formulas():
    from gem_core.attention.relative_bias import position_bucket, time_bucket

    d = torch.tensor([-7, -1, 0, 1, 2, 3, 4, 100])
    assert position_bucket(d, 4).tolist() == [3, 1, 0, 1, 2, 3, 3, 3]
    assert position_bucket(d, 1).tolist() == [0] * 8
    # floor(ln(max(1, |dt|)) / 0.301): ln 2 / 0.301 = 2.30, ln 10 / 0.301 = 7.65, capped at 9.
    dt = torch.tensor([0, 1, -1, 2, -10, 10, 10**6])
    assert time_bucket(dt, 10, 0.301).tolist() == [0, 0, 0, 2, 7, 7, 9]


def test_time_bucket_float32_matches_float64_where_documented():
    """The module promises backends agree for |dt| <= 10**4 at the default divisor: float32
    and float64 logarithms give the same bucket for every such dt."""
    from gem_core.attention.relative_bias import DEFAULT_TIME_BUCKET_DIVISOR, time_bucket

    dt = torch.arange(0, 10**4 + 1)
    exact = torch.floor(torch.log(dt.clamp(min=1).double()) / DEFAULT_TIME_BUCKET_DIVISOR).long()
    assert torch.equal(time_bucket(dt, 10**6), exact)


def test_relative_bias_validates_its_fields():
    with pytest.raises(ValueError, match="together"):
        RelativeBias(position_weights=torch.zeros(2, 3), time_weights=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="heads"):
        RelativeBias(position_weights=torch.zeros(2, 3), time_weights=torch.zeros(1, 4),
                     timestamps=torch.zeros(5, dtype=torch.int64))
    with pytest.raises(ValueError, match="integer"):
        RelativeBias(position_weights=torch.zeros(2, 3), time_weights=torch.zeros(2, 4),
                     timestamps=torch.zeros(5))
    with pytest.raises(ValueError, match="num_position_buckets"):
        RelativeBias(position_weights=torch.zeros(2))
    bias = RelativeBias(position_weights=torch.zeros(2, 3), time_weights=torch.zeros(2, 4),
                        timestamps=torch.zeros(5, dtype=torch.int64))
    x = torch.randn(6, 2, 8)
    offsets = torch.tensor([0, 6])
    with pytest.raises(ValueError, match="timestamps has 5 entries"):
        ReferenceAttention()(x, x, x, offsets, offsets, params=AttentionParams(), bias=bias)


def test_relative_bias_is_checked_against_the_declared_capabilities():
    """A model with relative bias needs a backend whose registration declares it: refused at
    start-up, naming the backend, the setting and the installed backends that declare it."""
    from gem_core.attention.choice import check_attention_backend
    from gem_core.capabilities import RELATIVE_BIAS, SOFTMAX
    from gem_core.config import ModelConfig
    from gem_core.errors import GemConfigError
    from gem_core.registry import ImplementationSpec

    def spec(name, *capabilities):
        return ImplementationSpec(name=name, load=ReferenceAttention, capabilities=capabilities)

    biased, plain = spec("biased", SOFTMAX, RELATIVE_BIAS), spec("plain", SOFTMAX)
    model = ModelConfig(relative_bias=True)
    check_attention_backend(model, biased, [biased, plain])
    with pytest.raises(GemConfigError, match=r"'plain' does not support relative_bias \(needed by "
                                        r"model.relative_bias = true\); backends that do: biased"):
        check_attention_backend(model, plain, [biased, plain])
