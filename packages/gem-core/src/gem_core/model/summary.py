"""Sizes of a configured model without allocating it: parameters and FLOPs per sample.

Built on the ``meta`` device, so a GPU-only preset with billions of embedding rows is described
on a laptop in a second (``gem config show`` prints this).
"""

from __future__ import annotations

from typing import Any

import torch

from gem_core.attention.reference import ReferenceAttention
from gem_core.config import ModelConfig
from gem_core.embedding import ReferenceEmbeddingBackend
from gem_core.flops import TRAIN_FACTOR
from gem_core.model.gem import GEMModel, build_model
from gem_core.schema import FeatureSchema


def meta_model(config: ModelConfig, schema: FeatureSchema) -> GEMModel:
    """The model with every tensor on ``meta``: shapes only, no memory, no initialisation cost."""
    with torch.device("meta"):
        return build_model(config, schema, attention=ReferenceAttention(),
                           embedding_backend=ReferenceEmbeddingBackend())


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """``embedding`` (sparse tables), ``dense`` (everything else) and ``total`` parameters."""
    embedding = sum(p.numel() for p in model.embeddings.parameters())
    total = sum(p.numel() for p in model.parameters())
    return {"embedding": embedding, "dense": total - embedding, "total": total}


def model_summary(config: ModelConfig, schema: FeatureSchema,
                  history_lengths: tuple[int, ...] | None = None) -> dict[str, Any]:
    """Parameter counts and training FLOPs (forward + backward) of one sample per history
    length (default: 0, the data's typical lengths and its cap ``schema.max_seq_len``), with the
    forward breakdown per module at the longest."""
    model = meta_model(config, schema)
    if history_lengths is None:
        cap = schema.max_seq_len
        history_lengths = tuple(sorted({0, min(64, cap), min(512, cap), cap}))
    per_sample = {}
    for length in history_lengths:
        counts = model.flops(torch.tensor([length]))
        per_sample[str(length)] = counts["total"]
    longest = torch.tensor([max(history_lengths)])
    return {
        "parameters": parameter_counts(model),
        "train_flops_per_sample_by_history_length": per_sample,
        "forward_flops_by_module_at_longest": model.flops_by_module(longest),
        "train_factor": TRAIN_FACTOR,
    }
