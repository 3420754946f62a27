"""The vectorised jagged mask equals the per-sample definition in gem_core.attention.masks."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gem_core.attention.api import AttentionParams
from gem_core.attention.masks import self_attention_mask
from gem_core.jagged import offsets_from_lengths
from gem_kernels.attention.jagged_mask import jagged_visible_mask


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=4),
    causal=st.booleans(),
    window=st.one_of(st.none(), st.integers(0, 14)),
    prefix=st.integers(0, 4),
    data=st.data(),
)
def test_matches_definition(lengths, causal, window, prefix, data):
    params = AttentionParams(causal=causal, window=window, num_prefix=prefix)
    targets = [data.draw(st.integers(0, n)) for n in lengths]
    offsets = offsets_from_lengths(torch.tensor(lengths))
    width = max(lengths)
    got = jagged_visible_mask(offsets, offsets, width, params, torch.tensor(targets), True)
    row = 0
    for n, t in zip(lengths, targets):
        want = torch.zeros(n, width, dtype=torch.bool)
        want[:, :n] = self_attention_mask(n, t, params)
        assert torch.equal(got[row:row + n], want)
        row += n
