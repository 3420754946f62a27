"""Activation checkpointing changes memory and time, never outputs or gradients."""

import copy

import pytest
import torch

from gem_core.attention.reference import ReferenceAttention
from gem_core.config import DataConfig, ModelConfig
from gem_core.distributed import ParallelContext
from gem_core.embedding import ReferenceEmbeddingBackend
from gem_core.errors import GemConfigError
from gem_core.model import build_model
from gem_core.plugins import build_plugins
from gem_core.train.loss import mean_loss
from gem_parallel.checkpointing import (
    FullCheckpointing,
    SelectiveCheckpointing,
    SelectiveOptions,
)


@pytest.fixture(scope="module")
def setup():
    source = build_plugins().data_source(DataConfig(max_seq_len=40), seed=1)
    torch.manual_seed(0)
    model = build_model(ModelConfig(embedding_dim=16, num_layers=2), source.schema,
                        attention=ReferenceAttention(),
                        embedding_backend=ReferenceEmbeddingBackend())
    return model, source.generate(12, split=1, index=0), source.schema.tasks


def _outputs_and_grads(model, batch, tasks):
    model.zero_grad(set_to_none=True)
    logits = model(batch)
    mean_loss(logits, batch, tasks).backward()
    return logits, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("policy, options", [
    (FullCheckpointing(), None),
    (SelectiveCheckpointing(), SelectiveOptions()),
    (SelectiveCheckpointing(), SelectiveOptions(modules=("mlp",))),
    (SelectiveCheckpointing(), SelectiveOptions(modules=("attention", "mlp"))),
])
def test_outputs_and_gradients_equal_no_checkpointing_exactly(setup, policy, options):
    model, batch, tasks = setup
    checkpointed = policy.apply(copy.deepcopy(model), ctx=ParallelContext(), options=options)
    assert [n for n, _ in checkpointed.named_parameters()] == \
        [n for n, _ in model.named_parameters()]  # names (state dicts, FSDP units) unchanged
    expected_logits, expected_grads = _outputs_and_grads(model, batch, tasks)
    logits, grads = _outputs_and_grads(checkpointed, batch, tasks)
    for task in expected_logits:
        assert torch.equal(logits[task], expected_logits[task])
    assert grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        assert torch.equal(grads[name], grad), name
    # A deep copy (the sharded engines' evaluation replica) recomputes its own blocks.
    replica = copy.deepcopy(checkpointed)
    replica_logits, _ = _outputs_and_grads(replica, batch, tasks)
    assert torch.equal(replica_logits[tasks[0]], expected_logits[tasks[0]])


def test_checkpointing_saves_activation_memory(setup):
    from gem_parallel.bench_memory import saved_activation_bytes

    model, batch, tasks = setup
    plain = saved_activation_bytes(model, batch, tasks)
    full = FullCheckpointing().apply(copy.deepcopy(model), ctx=ParallelContext(), options=None)
    assert saved_activation_bytes(full, batch, tasks) < plain


def test_options_are_validated_once_when_the_policy_is_resolved():
    plugins = build_plugins()

    def resolve(name, options):
        return plugins.resolve("activation_checkpointing", name, None, options)

    with pytest.raises(GemConfigError, match="unknown key "
                                             "'parallel.activation_checkpointing.module'"):
        resolve("selective", {"module": ["mlp"]})
    with pytest.raises(GemConfigError, match="parallel.activation_checkpointing.modules"):
        resolve("selective", {"modules": ["norm"]})
    with pytest.raises(GemConfigError, match="activation_checkpointing 'full' takes no options"):
        resolve("full", {"modules": ["mlp"]})
    assert resolve("selective", {"modules": ["mlp"]}).options == SelectiveOptions(modules=("mlp",))
    assert resolve("full", {}).options is None


def test_full_checkpointing_covers_cross_attention_layers_and_keeps_gradients():
    import torch

    from gem_core.attention.bucketed import BucketedAttention
    from gem_core.config import load_config
    from gem_core.distributed import ParallelContext
    from gem_core.embedding import ReferenceEmbeddingBackend
    from gem_core.model import build_model
    from gem_core.plugins import build_plugins
    from gem_parallel.checkpointing import CheckpointedForward, FullCheckpointing

    config = load_config(overrides=["model.cross_attention=true", "data.max_seq_len=24",
                                    "data.options.num_items=200"])
    source = build_plugins().data_source(config.data, seed=0)
    batch = source.generate(16, split=1, index=0)

    def grads(checkpointed: bool):
        torch.manual_seed(0)
        model = build_model(config.model, source.schema, attention=BucketedAttention(),
                            embedding_backend=ReferenceEmbeddingBackend())
        if checkpointed:
            FullCheckpointing().apply(model, ctx=ParallelContext(), options=None)
            assert model.tower.cross and all(
                isinstance(layer.__dict__.get("forward"), CheckpointedForward)
                for layer in model.tower.cross)
        sum(v.sum() for v in model(batch).values()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, checkpointed = grads(False), grads(True)
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=0, atol=0)
