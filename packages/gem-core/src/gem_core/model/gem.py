"""The GEM model, assembled from injected backends. It never imports parallelism or kernels."""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor, nn

from gem_core.attention import AttentionBackend, AttentionParams
from gem_core.batch import JaggedBatch
from gem_core.config import ModelConfig
from gem_core.embedding import EmbeddingTableConfig
from gem_core.flops import TRAIN_FACTOR, attention_flops, causal_window_pairs
from gem_core.jagged import Jagged
from gem_core.model.interaction import DotInteractionMLP
from gem_core.model.sequence_tower import SequenceTower
from gem_core.model.target_attention import TargetAwareAttention
from gem_core.model.tokens import EventTokenizer
from gem_core.schema import FeatureSchema

ITEM_TABLE = "item"


def embedding_tables(config: ModelConfig, schema: FeatureSchema) -> list[EmbeddingTableConfig]:
    """The sparse tables of the model: one item table shared by history and candidate, one per
    sparse feature (pooled) and one per candidate feature."""
    dim = config.embedding_dim
    tables = [EmbeddingTableConfig(name=ITEM_TABLE, num_embeddings=schema.num_items, dim=dim,
                                   pooling="none", features=("history_item", "candidate_item"))]
    tables += [EmbeddingTableConfig(name=f.name, num_embeddings=f.num_embeddings, dim=dim,
                                    pooling=f.pooling, features=(f.name,))
               for f in schema.sparse_features]
    tables += [EmbeddingTableConfig(name=f"candidate_{f.name}", num_embeddings=f.num_embeddings,
                                    dim=dim, pooling="sum", features=(f"candidate_{f.name}",))
               for f in schema.candidate_features]
    return tables


class GEMModel(nn.Module):
    """Embeddings -> sequence tower -> target-aware attention -> interaction -> task heads."""

    def __init__(self, config: ModelConfig, schema: FeatureSchema, *,
                 attention: AttentionBackend, embeddings: nn.Module) -> None:
        super().__init__()
        dim = config.embedding_dim
        self.config, self.schema = config, schema
        self.embeddings = embeddings
        self.events = EventTokenizer(dim, schema.num_actions, config.time_buckets,
                                     schema.seq_dense_dim)
        self.attention_params = AttentionParams(
            causal=True, window=config.window or None, normalization=config.normalization
        )
        self.tower = SequenceTower(dim, config.num_heads, config.num_layers,
                                   int(config.mlp_ratio * dim), self.attention_params, attention)
        self.target_attention = TargetAwareAttention(dim, config.num_heads, attention)
        self.dense_proj = nn.Linear(schema.num_dense, dim) if schema.num_dense else None
        # candidate, target-aware summary, history mean, sparse features, dense
        self.num_tokens = 3 + len(schema.sparse_features) + (1 if schema.num_dense else 0)
        self.interaction = DotInteractionMLP(self.num_tokens, dim, config.interaction_dims,
                                             config.dropout)
        self.heads = nn.ModuleDict({t: nn.Linear(self.interaction.out_dim, 1)
                                    for t in schema.tasks})

    def sparse_features(self, batch: JaggedBatch) -> dict[str, Jagged]:
        one_per_row = torch.arange(batch.batch_size + 1, device=batch.seq_offsets.device)
        features = {
            "history_item": Jagged(batch.seq_item_ids, batch.seq_offsets),
            "candidate_item": Jagged(batch.candidate_item_ids, one_per_row),
        }
        features.update(batch.sparse)
        features.update({f"candidate_{name}": Jagged(ids, one_per_row)
                         for name, ids in batch.candidate_sparse.items()})
        return features

    def forward(self, batch: JaggedBatch) -> dict[str, Tensor]:
        """Logits per task, each ``(B,)``."""
        looked_up = self.embeddings(self.sparse_features(batch))
        offsets = batch.seq_offsets
        lengths = batch.seq_lengths()
        max_len = int(lengths.max()) if lengths.numel() else 0
        rows = torch.repeat_interleave(torch.arange(batch.batch_size, device=offsets.device),
                                       lengths)
        ages = batch.request_timestamps[rows] - batch.seq_timestamps
        events = self.events(looked_up["history_item"], batch.seq_action_ids, ages,
                             batch.seq_dense)
        history = self.tower(events, offsets, max_len)

        candidate = looked_up["candidate_item"]
        for feature in self.schema.candidate_features:
            candidate = candidate + looked_up[f"candidate_{feature.name}"]
        candidate_content = self.events.content_vector(batch.candidate_dense)
        if candidate_content is not None:
            candidate = candidate + candidate_content
        target_summary = self.target_attention(candidate, history, offsets, max_len)
        history_mean = torch.zeros_like(candidate).index_add_(0, rows, history)
        history_mean = history_mean / lengths.clamp(min=1).unsqueeze(1).to(history.dtype)

        tokens = [candidate, target_summary, history_mean]
        tokens += [looked_up[f.name] for f in self.schema.sparse_features]
        if self.dense_proj is not None:
            tokens.append(self.dense_proj(batch.dense))
        shared = self.interaction(torch.stack(tokens, dim=1))
        return {task: head(shared).squeeze(-1) for task, head in self.heads.items()}

    def flops(self, lengths: Tensor) -> Mapping[str, int]:
        """Training FLOPs (3 x forward) of one batch with these history lengths, jagged and as
        if every history were padded to the batch maximum."""
        c = self.config
        dim, hidden = c.embedding_dim, int(c.mlp_ratio * c.embedding_dim)
        lengths = lengths.to(torch.int64)
        batch = lengths.numel()
        max_len = int(lengths.max()) if batch else 0
        per_token_linear = 2 * (dim * 3 * dim + dim * dim + dim * 2 * hidden + hidden * dim)
        window = c.window or None

        def tower_and_target(tokens: int, pairs: int) -> tuple[int, int]:
            linear = c.num_layers * per_token_linear * tokens
            attention = c.num_layers * attention_flops(pairs, dim)
            # target-aware attention: 1 query per sample over its history
            linear += 2 * (dim * 2 * dim) * tokens + 2 * 2 * dim * dim * batch
            attention += attention_flops(tokens, dim)
            return linear, attention

        tokens = int(lengths.sum())
        pairs = int(causal_window_pairs(lengths, window).sum())
        linear, attention = tower_and_target(tokens, pairs)
        padded_tokens = batch * max_len
        padded_pairs = batch * max_len * max_len  # a padded kernel computes every tile
        padded_linear, padded_attention = tower_and_target(padded_tokens, padded_pairs)
        head = sum(2 * m.in_features * m.out_features * batch
                   for m in self.interaction.modules() if isinstance(m, nn.Linear))
        head += 2 * batch * self.num_tokens ** 2 * dim
        return {
            "total": TRAIN_FACTOR * (linear + attention + head),
            "attention": TRAIN_FACTOR * attention,
            "padded_total": TRAIN_FACTOR * (padded_linear + padded_attention + head),
            "padded_attention": TRAIN_FACTOR * padded_attention,
        }


def build_model(config: ModelConfig, schema: FeatureSchema, *, attention: AttentionBackend,
                embedding_backend) -> GEMModel:
    """The model for ``schema`` with the given attention callable and embedding backend."""
    embeddings = embedding_backend.build(embedding_tables(config, schema))
    return GEMModel(config, schema, attention=attention, embeddings=embeddings)
