"""The reference backend passes the conformance suite it is the oracle of (a sanity check of both:
the suite's float64 comparison must accept the reference run in float32 and bfloat16)."""

import attrs
import pytest
import torch

from gem_core.attention.api import AttentionParams
from gem_core.attention.reference import ReferenceAttention
from gem_core.testing import AttentionCase, AttentionConformance


class TestReferenceConformance(AttentionConformance):
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
