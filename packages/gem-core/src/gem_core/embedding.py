"""The reference (plain PyTorch) embedding backend and the start-up check of the embedding choice.

The tables' configuration lives in :mod:`gem_core.embedding_tables` (a data module the contracts
can name without importing a backend); ``EmbeddingTableConfig`` and ``check_ids`` are importable
from here too."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

import torch.nn.functional as F
from torch import Tensor, nn

from gem_core.capabilities import FUSED_OPTIMIZER, MANAGED_IDS, WHO_DECLARES
from gem_core.config.model_schema import EmbeddingOptimizerConfig, ModelConfig
from gem_core.contracts import EmbeddingBackend
from gem_core.embedding_tables import EmbeddingTableConfig, check_ids
from gem_core.errors import GemConfigError
from gem_core.jagged import Jagged

if TYPE_CHECKING:
    from gem_core.registry import ImplementationSpec

__all__ = ["EmbeddingTableConfig", "ReferenceEmbeddingBackend", "ReferenceEmbeddingCollection",
           "check_fused_optimizer", "check_ids"]

SINGLE_PROCESS_EMBEDDING_SHARDING = "replicated"
"""The embedding sharding that leaves ``model.embeddings`` as its backend built it (one rank)."""



def check_fused_optimizer(config: ModelConfig, *, embedding: ImplementationSpec,
                          embedding_sharding: ImplementationSpec, world_size: int) -> None:
    """At start-up: refuse a ``[model.embedding_optimizer]`` that the embedding backend would not
    use, and a backend with the :data:`FUSED_OPTIMIZER` capability where its in-backward updates
    would go wrong: on several ranks each replica would apply only its own rank's gradients (the
    copies drift apart), and another embedding sharding would replace the module with its own
    tables and optimizer."""
    fused = FUSED_OPTIMIZER in embedding.capabilities
    chosen = config.embedding_optimizer
    if (not fused and chosen.dense_tables == "adamw"
            and chosen != EmbeddingOptimizerConfig()):
        raise GemConfigError(
            f"model.embedding_optimizer is set, but the embedding backend {embedding.name!r} "
            f"trains its tables with the dense optimizer (AdamW at train.lr); set "
            f"model.embedding_optimizer.dense_tables = 'same' (or 'auto') for this optimizer in "
            f"the dense step, use an embedding backend that declares {FUSED_OPTIMIZER} "
            f"({WHO_DECLARES}; --set backends.embedding=NAME) or leave "
            "[model.embedding_optimizer] at its defaults")
    if not fused:
        return
    if world_size > 1:
        raise GemConfigError(
            f"the embedding backend {embedding.name!r} updates its tables inside the backward "
            f"with each rank's own gradients: on {world_size} ranks the replicas would drift "
            "apart; for several ranks use --embedding-sharding torchrec (TorchRec's sharded "
            "FBGEMM tables with their own fused optimizer, [parallel.embedding]) with "
            "backends.embedding=reference")
    if embedding_sharding.name != SINGLE_PROCESS_EMBEDDING_SHARDING:
        raise GemConfigError(
            f"the embedding backend {embedding.name!r} keeps its tables and fused optimizer in "
            f"one process; embedding sharding {embedding_sharding.name!r} would replace them; "
            f"use --embedding-sharding {SINGLE_PROCESS_EMBEDDING_SHARDING} (or auto)")


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
                             f"backend with the {MANAGED_IDS} capability (torchrec-managed)")
        self.table_configs = {t.name: t for t in tables}
        self.tables = nn.ModuleDict(
            {t.name: nn.Embedding(t.num_embeddings, t.dim) for t in tables}
        )
        self.init_std = init_std
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


class ReferenceEmbeddingBackend(EmbeddingBackend):
    """The ``reference`` embedding backend."""

    def build(self, tables: Sequence[EmbeddingTableConfig]) -> nn.Module:
        return ReferenceEmbeddingCollection(tables)
