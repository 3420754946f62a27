"""Embedding tables: their configuration and the reference (plain PyTorch) backend."""

from __future__ import annotations

from typing import Mapping, Sequence

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gem_core.config.validators import choice, greater_than
from gem_core.jagged import Jagged


@attrs.frozen(kw_only=True)
class EmbeddingTableConfig:
    """One embedding table and the features looked up in it."""

    name: str
    """Table name (unique in the model)."""

    num_embeddings: int = attrs.field(validator=greater_than(0))
    """Rows of the table: valid ids are ``0 .. num_embeddings - 1``."""

    dim: int = attrs.field(validator=greater_than(0))
    """Width of each row."""

    pooling: str = attrs.field(default="sum", validator=choice("sum", "mean", "none"))
    """``none``: one vector per id (sequences); ``sum``/``mean``: one vector per bag."""

    features: tuple[str, ...] = attrs.field(converter=tuple)
    """Feature names whose ids index this table."""


def check_ids(ids: Tensor, table: EmbeddingTableConfig, feature: str) -> None:
    """Raise ValueError naming table, feature and the first id outside the table."""
    if ids.numel() == 0:
        return
    bad = (ids < 0) | (ids >= table.num_embeddings)
    if bool(bad.any()):
        first = int(ids[bad][0])
        raise ValueError(
            f"embedding table {table.name!r}, feature {feature!r}: id {first} is outside "
            f"[0, {table.num_embeddings}) ({int(bad.sum())} such ids)"
        )


class ReferenceEmbeddingCollection(nn.Module):
    """One ``nn.Embedding`` per table; pooled lookups through ``F.embedding_bag``."""

    def __init__(self, tables: Sequence[EmbeddingTableConfig], init_std: float = 0.05) -> None:
        super().__init__()
        self.table_configs = {t.name: t for t in tables}
        self.tables = nn.ModuleDict(
            {t.name: nn.Embedding(t.num_embeddings, t.dim) for t in tables}
        )
        for table in self.tables.values():
            nn.init.normal_(table.weight, std=init_std)

    def forward(self, features: Mapping[str, Jagged]) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for name, config in self.table_configs.items():
            weight = self.tables[name].weight
            for feature in config.features:
                jagged = features[feature]
                check_ids(jagged.values, config, feature)
                if config.pooling == "none":
                    out[feature] = F.embedding(jagged.values, weight)
                else:
                    out[feature] = F.embedding_bag(
                        jagged.values, weight, jagged.offsets[:-1], mode=config.pooling
                    )
        return out


class ReferenceEmbeddingBackend:
    """The ``reference`` embedding backend."""

    def build(self, tables: Sequence[EmbeddingTableConfig]) -> nn.Module:
        return ReferenceEmbeddingCollection(tables)
