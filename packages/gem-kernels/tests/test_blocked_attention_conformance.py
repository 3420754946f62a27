"""The blocked backend passes the suite with its automatic tiles and with tiles forced small,
so that most samples span several tiles and most tiles hold several samples."""

import pytest
import torch

from gem_core.attention import AttentionParams
from gem_core.attention.reference import reference_attention
from gem_core.testing import AttentionConformance
from gem_kernels.attention.blocked_backend import BlockedAttention, auto_block


class TestBlockedConformance(AttentionConformance):
    registered_as = "blocked"
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    max_examples = 20

    def make_backend(self):
        return BlockedAttention()


class TestBlockedSmallTilesConformance(AttentionConformance):
    registered_as = "blocked"
    dtypes = (torch.float32,)
    max_examples = 20

    def make_backend(self):
        return BlockedAttention(block_q=4, block_k=2)


def test_key_spans_follow_the_window():
    """A causal window of 8 over one sample of 256 tokens needs a band of keys per query tile,
    not everything before it: the output matches the reference and no span exceeds 2 blocks."""
    from gem_kernels.attention import blocked_tiles as blocked

    torch.manual_seed(0)
    q, k, v = (torch.randn(256, 2, 8, dtype=torch.float64) for _ in range(3))
    offsets = torch.tensor([0, 256])
    params = AttentionParams(causal=True, window=8)
    got = blocked.blocked_attention(q, k, v, offsets, offsets, params=params, block_q=8,
                                    block_k=8)
    want = reference_attention(q, k, v, offsets, offsets, params=params)
    torch.testing.assert_close(got, want)
    qs = blocked._Stream(q, offsets, 8, torch.float64)
    lo, hi, _ = blocked._key_range(qs, 256, offsets, offsets, True, params, None)
    _, _, groups = blocked._span_groups(qs, 256, 8, lo, hi)
    assert max(width for width, _ in groups) <= 16  # not up to 256


def test_round_units_is_a_quarter_octave_series():
    from gem_kernels.attention.blocked_tiles import _round_units

    got = _round_units(torch.tensor([1, 2, 3, 4, 5, 7, 9, 13, 17, 33, 100])).tolist()
    assert got == [1, 2, 3, 4, 5, 7, 10, 14, 20, 40, 112]


@pytest.mark.parametrize("tokens,samples,window,expected", [
    (3600, 16, None, 64), (24, 8, None, 8), (3600, 16, 16, 8), (0, 0, None, 8)])
def test_auto_block(tokens, samples, window, expected):
    assert auto_block(tokens, samples, window) == expected


def test_rejects_bad_block_sizes():
    with pytest.raises(ValueError, match="block_q must be None"):
        BlockedAttention(block_q=0)
