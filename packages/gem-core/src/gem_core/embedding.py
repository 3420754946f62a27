"""Embedding tables: their configuration and the reference (plain PyTorch) backend."""

from __future__ import annotations

from typing import Mapping, Sequence

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gem_core.config.validators import choice, greater_than
from gem_core.jagged import Jagged
from gem_core.schema import EmbeddingTable


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

    managed: EmbeddingTable | None = None
    """The declared table when its id policy is ``managed``: its features then reach the backend
    as raw 64-bit ids, which the backend's managed-collision remapper turns into rows (with the
    table's eviction settings). Only backends that declare the ``managed_ids`` capability
    (:data:`gem_core.ids.MANAGED_IDS`) accept such a table."""


def check_ids(ids: Tensor, table: EmbeddingTableConfig, feature: str) -> None:
    """Raise ValueError naming table, feature and the first id outside the table."""
    if ids.numel() == 0:
        return
    bad = (ids < 0) | (ids >= table.num_embeddings)
    if torch.compiler.is_compiling():
        # A captured graph (torch.export, AOTInductor) cannot branch on values: it asserts.
        torch._assert_async(~bad.any(), f"embedding table {table.name!r}, feature {feature!r}: "
                            f"an id is outside [0, {table.num_embeddings})")
        return
    if bool(bad.any()):
        first = int(ids[bad][0])
        raise ValueError(
            f"embedding table {table.name!r}, feature {feature!r}: id {first} is outside "
            f"[0, {table.num_embeddings}) ({int(bad.sum())} such ids)"
        )


class ReferenceEmbeddingCollection(nn.Module):
    """One ``nn.Embedding`` per table; pooled lookups through ``F.embedding_bag``."""

    #: Backends built on this collection that remap managed ids set this (see ``managed``).
    accepts_managed_ids = False

    def __init__(self, tables: Sequence[EmbeddingTableConfig], init_std: float = 0.05) -> None:
        super().__init__()
        managed = [t.name for t in tables if t.managed is not None]
        if managed and not self.accepts_managed_ids:
            raise ValueError(f"embedding table(s) {', '.join(managed)} have id_policy 'managed', "
                             f"which {type(self).__name__} does not remap; use an embedding "
                             "backend with the managed_ids capability (torchrec-managed)")
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
