"""``model.dense_tokens``: one token of all dense features, or a token of each."""

from __future__ import annotations

import torch

from gem_core.model.dense_tokens import PerFeatureDenseTokens
from gem_core.testing.models import small_model, synthetic_batch


def test_each_feature_gets_its_own_token_in_float64():
    torch.manual_seed(0)
    tokens = PerFeatureDenseTokens(3, 5).double()
    with torch.no_grad():
        tokens.bias.copy_(torch.randn(3, 5, dtype=torch.float64))
    dense = torch.randn(4, 3, dtype=torch.float64) * 2.0
    out = tokens(dense)
    assert out.shape == (4, 3, 5)
    for r in range(4):
        for i in range(3):
            expected = dense[r, i] * tokens.weight[i] + tokens.bias[i]
            assert torch.allclose(out[r, i], expected, rtol=0, atol=1e-14)
    # A feature's token moves with that feature alone.
    moved = dense.clone()
    moved[:, 1] += 1.0
    delta = tokens(moved) - out
    assert torch.allclose(delta[:, 1], tokens.weight[1].expand(4, 5), rtol=0, atol=1e-14)
    assert delta[:, [0, 2]].abs().max() == 0


def test_per_feature_adds_a_context_token_per_dense_feature():
    schema, batch = synthetic_batch(6, max_seq_len=16, seed=1)
    assert schema.num_dense >= 2
    one = small_model(schema)
    each = small_model(schema, dense_tokens="per_feature")
    assert each.num_context == one.num_context - 1 + schema.num_dense
    assert each.num_tokens == one.num_tokens - 1 + schema.num_dense
    assert each.dense_proj is None and one.dense_tokens is None
    # The default layout's parameters (and so its checkpoints) are what they were.
    assert not any(name.startswith("dense_tokens") for name in one.state_dict())
    out = each(batch)
    assert set(out) == set(schema.tasks)
    assert all(torch.isfinite(v).all() for v in out.values())
