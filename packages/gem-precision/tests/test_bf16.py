import torch

from gem_core.attention.bucketed import BucketedAttention
from gem_core.config import load_config
from gem_core.embedding import ReferenceEmbeddingBackend
from gem_core.model import build_model
from gem_core.plugins import build_plugins
from gem_precision.bf16 import BFloat16Recipe


def test_bf16_autocast_keeps_fp32_master_weights_and_stays_close_to_fp32():
    config = load_config(overrides=["data.max_seq_len=32", "data.options.num_items=200"])
    source = build_plugins().data_source(config.data, seed=1)
    torch.manual_seed(0)
    model = build_model(config.model, source.schema, attention=BucketedAttention(),
                        embedding_backend=ReferenceEmbeddingBackend())
    batch = source.generate(32, split=1, index=0)
    recipe = BFloat16Recipe()
    assert recipe.convert(model, None, None) is model
    with torch.no_grad():
        reference = model(batch)
        with recipe.autocast("cpu"):
            low = model(batch)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    for task in reference:
        assert low[task].dtype == torch.bfloat16  # the heads really ran in bf16
        assert not torch.equal(low[task].float(), reference[task])
        torch.testing.assert_close(low[task].float(), reference[task], atol=5e-2, rtol=5e-2)
    policy = recipe.mixed_precision_policy()
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32


def test_bf16_declares_no_options_and_core_refuses_any():
    import pytest

    from gem_core.errors import GemConfigError

    spec = build_plugins().registry("precision").get("bf16")
    assert spec.options is None and spec.structure_options({}) is None
    with pytest.raises(GemConfigError, match="precision 'bf16' takes no options; got min_dim"):
        spec.structure_options({"min_dim": 16})
