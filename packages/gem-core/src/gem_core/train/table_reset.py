"""Fresh feature tables at each pass after the first (``train.tables_each_pass = "reinitialize"``).

CTR models trained for a second pass over the same impressions get worse at its start (the
"one-epoch" overfitting: Zhang et al., CIKM 2022). MEDA (Fan et al., 2024) places the cause in the
id embeddings, which memorise the impressions they were trained on, and trains several passes by
drawing the embedding tables anew at the start of each pass while the layers above carry on: those
learn relations between embeddings, which a new draw keeps, and each pass shows them the data
through other embeddings (an augmentation).

What is reset: the rows of the model's feature tables (``model.embeddings``, the tables of
``[[tables]]``; the age and position buckets are not feature tables) from their initial
distribution, with a generator seeded by ``train.seed`` and the pass, so every rank draws the same
replicated rows and a resumed run the same values; and the optimizer state of those parameters
(AdamW's moments and step count, row-wise Adagrad's sums), zeroed in place so that a checkpoint
keeps the same keys. When: before the first step of the next pass (after the evaluation and the
checkpoint of the step that ended the pass), so the checkpoint of that step holds the trained
tables and a run resumed from it resets them again; the number of resets done is in the
checkpoint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from gem_core.capabilities import FUSED_OPTIMIZER, TABLE_OPTIMIZER, declared_by
from gem_core.embedding import SINGLE_PROCESS_EMBEDDING_SHARDING, ReferenceEmbeddingCollection
from gem_core.errors import GemConfigError

if TYPE_CHECKING:
    from gem_core.plugins import GemPlugins
    from gem_core.registry import ImplementationSpec

#: Mixed with ``train.seed`` so the tables' draws are a stream of their own.
_STREAM = 0x7AB1E5


def check_table_reset(*, tables: nn.Module, embedding: ImplementationSpec,
                      embedding_sharding: ImplementationSpec,
                      dense_sharding: ImplementationSpec, plugins: GemPlugins,
                      has_passes: bool, time_order: bool) -> None:
    """At start-up, with ``train.tables_each_pass = "reinitialize"``: a refusal naming what
    this run's backends or data cannot do, or nothing."""
    what = "train.tables_each_pass = 'reinitialize'"
    if time_order:
        raise GemConfigError(f"{what}: data.order = 'time' trains one pass over the windows; "
                             "there is no second pass to start with fresh tables")
    if not has_passes:
        raise GemConfigError(f"{what} needs data whose passes the trainer counts (a file-backed "
                             "source in batches of train.batch_size requests); this source's "
                             "batches have none (generated on demand, or cut by a token budget)")
    if FUSED_OPTIMIZER in embedding.capabilities:
        raise GemConfigError(f"{what}: the embedding backend {embedding.name!r} trains its tables "
                             "inside the backward with an optimizer of its own; use the "
                             "'reference' embedding backend")
    if embedding_sharding.name != SINGLE_PROCESS_EMBEDDING_SHARDING:
        raise GemConfigError(f"{what}: the embedding sharding {embedding_sharding.name!r} replaces "
                             "the tables with its own; --embedding-sharding "
                             f"{SINGLE_PROCESS_EMBEDDING_SHARDING} leaves them to the model")
    if TABLE_OPTIMIZER not in dense_sharding.capabilities:
        able = declared_by(plugins.registry("dense_sharding").specs(), TABLE_OPTIMIZER)
        raise GemConfigError(f"{what}: the dense sharding {dense_sharding.name!r} does not hold "
                             f"the tables as the model's parameters under the optimizer the "
                             f"trainer built ({TABLE_OPTIMIZER}); those that do: {able}")
    if not isinstance(tables, ReferenceEmbeddingCollection):
        raise GemConfigError(f"{what}: the model's feature tables ({type(tables).__name__}) "
                             "cannot draw their rows anew (no "
                             "ReferenceEmbeddingCollection.reinitialize)")


def check_tables_whole(tables: ReferenceEmbeddingCollection, dense_sharding: str) -> None:
    """After the model is parallelized: a refusal where the dense sharding split the tables'
    rows across ranks (FSDP2's DTensors). The draw is seeded alike on every rank, which is
    right for whole (replicated) tables and would give every rank's shard the same rows."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(weight, DTensor) for weight in table_parameters(tables)):
        raise GemConfigError(
            f"train.tables_each_pass = 'reinitialize': the dense sharding {dense_sharding!r} "
            "splits the feature tables' rows across ranks, and fresh rows are drawn for whole "
            "tables only (one process, or replicated: ddp)")


def table_parameters(tables: ReferenceEmbeddingCollection) -> list[nn.Parameter]:
    """The feature tables' weights, in a fixed order."""
    return [tables.tables[name].weight for name in sorted(tables.tables)]


@torch.no_grad()
def reinitialize_tables(tables: ReferenceEmbeddingCollection, optimizer: torch.optim.Optimizer,
                        *, seed: int, passes: int) -> None:
    """Draw the tables' rows anew for the pass after ``passes`` completed ones and zero their
    optimizer state (module docstring)."""
    weights = table_parameters(tables)
    generator = torch.Generator(device=weights[0].device)
    generator.manual_seed((seed * 1_000_003 + passes) ^ _STREAM)
    tables.reinitialize(generator)
    for weight in weights:
        for value in optimizer.state.get(weight, {}).values():
            if isinstance(value, torch.Tensor):
                value.zero_()
