"""Tiny GEM models and batches shared by the precision tests (shapes kept small: 2 CPU cores)."""

import pytest
import torch

from gem_core.attention.bucketed import BucketedAttention
from gem_core.config import load_config
from gem_core.embedding import ReferenceEmbeddingBackend
from gem_core.model import build_model
from gem_core.plugins import build_plugins
from gem_core.train.loss import mean_loss

TINY = ["data.max_seq_len=32", "data.options.num_items=200"]


@pytest.fixture(scope="session")
def source():
    return build_plugins().data_source(load_config(overrides=TINY).data, seed=1)


@pytest.fixture
def make_model(source):
    def make():
        torch.manual_seed(0)
        config = load_config(overrides=TINY)
        return build_model(config.model, source.schema, attention=BucketedAttention(),
                           embedding_backend=ReferenceEmbeddingBackend())
    return make


@pytest.fixture(scope="session")
def batches(source):
    return [source.generate(32, split=0, index=i) for i in range(2)]


@pytest.fixture(scope="session")
def recipe_options():
    """``recipe_options(name, **table)``: ``table`` as ``[precision.options]`` of recipe
    ``name``, structured as a run does (by gem-core, into the options class its spec
    declares)."""
    registry = build_plugins().registry("precision")
    return lambda name, **table: registry.get(name).structure_options(table)


@pytest.fixture(scope="session")
def loss_fn(source):
    tasks = source.schema.tasks
    return lambda logits, batch: mean_loss(logits, batch, tasks)
