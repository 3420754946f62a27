"""Small GEM models and batches for tests of model parts, FLOP counts and plugins."""

from __future__ import annotations

from typing import Any

import torch

from gem_core.attention.reference import ReferenceAttention
from gem_core.batch import JaggedBatch
from gem_core.config import DataConfig, ModelConfig
from gem_core.contracts import StrategyModel, check_checkpoint_kind
from gem_core.embedding import ReferenceEmbeddingBackend
from gem_core.model import build_model
from gem_core.model.gem import GEMModel
from gem_core.model.moe import moe_layers
from gem_core.plugins import build_plugins
from gem_core.schema import FeatureSchema


def small_model(schema: FeatureSchema, *, embedding_dim: int = 16, **model_options: Any
                ) -> GEMModel:
    """A GEM model of width 16 on the reference backends, seeded, with ``model_options``
    overriding :class:`ModelConfig` fields."""
    torch.manual_seed(0)
    return build_model(ModelConfig(embedding_dim=embedding_dim, **model_options), schema,
                       attention=ReferenceAttention(),
                       embedding_backend=ReferenceEmbeddingBackend())


def synthetic_batch(rows: int, *, max_seq_len: int, seed: int = 0, candidates: int = 1
                    ) -> tuple[FeatureSchema, JaggedBatch]:
    """The schema and one eval-split batch of gem-core's synthetic source: ``rows`` requests
    of ``candidates`` candidates each."""
    data = DataConfig(max_seq_len=max_seq_len, options={"candidates_per_request": candidates})
    source = build_plugins().data_source(data, seed=seed)
    return source.schema, source.generate(rows, split=1, index=0)


class LayersInterface(StrategyModel):
    """The strategy interface of a test model made of a few layers (mix it into the
    ``nn.Module``): no parallel units, nothing to checkpoint or stash, its mixture-of-experts
    layers found by type."""

    def parallel_units(self) -> list:
        return []

    def checkpoint_parts(self, kind: str) -> list:
        check_checkpoint_kind(kind)
        return []

    def moe_layers(self) -> list:
        return moe_layers(self)

    def stash_points(self) -> dict:
        return {}
