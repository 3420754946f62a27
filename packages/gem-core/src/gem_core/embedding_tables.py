"""The configuration of embedding tables and the id check every backend applies: data only, so
that the plugin contracts (:mod:`gem_core.contracts`) can name them without importing a backend."""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

from gem_core.config.model_schema import EmbeddingOptimizerConfig
from gem_core.config.validators import choice, greater_than
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

    optimizer: EmbeddingOptimizerConfig = attrs.field(factory=EmbeddingOptimizerConfig)
    """How a backend with the :data:`~gem_core.capabilities.FUSED_OPTIMIZER` capability trains
    this table (``[model.embedding_optimizer]``); other backends leave the table to the dense
    optimizer."""


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
