"""Fresh feature tables at each pass after the first (``train.tables_each_pass = "reinitialize"``).

CTR models trained for a second pass over the same impressions get worse at its start (the
"one-epoch" overfitting: Zhang et al., CIKM 2022). MEDA (Fan et al., 2024) places the cause in the
id embeddings, which memorise the impressions they were trained on, and trains several passes by
drawing the embedding tables anew at the start of each pass while the layers above carry on: those
learn relations between embeddings, which a new draw keeps, and each pass shows them the data
through other embeddings (an augmentation).

What is reset: the rows of the model's feature tables (``model.embeddings``, the tables of
``[[tables]]``; the age and position buckets are not feature tables) from their initial
distribution; and the optimizer state of those parameters (AdamW's moments and step count,
row-wise Adagrad's sums), zeroed in place so that a checkpoint keeps the same keys.

How the rows are drawn: in blocks of ``DRAW_BLOCK_ROWS`` rows, each block from a generator seeded
by ``train.seed``, the pass, the table and the block. A row's value therefore depends on where it
is in its table and on nothing about the layout: one process, replicated ranks (``ddp``), the
dim-0 shards of FSDP2 and HSDP (each rank draws only the blocks its rows fall in, and replicas of
a shard draw the same rows) and a resumed run all hold the same tables, whatever the world size.

When: before the first step of the next pass (after the evaluation and the
checkpoint of the step that ended the pass), so the checkpoint of that step holds the trained
tables and a run resumed from it resets them again; the number of resets done is in the
checkpoint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch
from torch import nn

from gem_core.capabilities import FUSED_OPTIMIZER, TABLE_OPTIMIZER, declared_by
from gem_core.distributed import local_part
from gem_core.embedding import SINGLE_PROCESS_EMBEDDING_SHARDING, ReferenceEmbeddingCollection
from gem_core.errors import GemConfigError
from gem_core.train.table_optimizer import PRIOR

if TYPE_CHECKING:
    from gem_core.plugins import GemPlugins
    from gem_core.registry import ImplementationSpec

#: Mixed with ``train.seed`` so the tables' draws are a stream of their own.
_STREAM = 0x7AB1E5

#: Rows drawn from one generator: large enough that seeding costs nothing next to the draw,
#: small enough that a rank holding a few rows of a large table draws little beyond them.
DRAW_BLOCK_ROWS = 4096


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
                             "are not a ReferenceEmbeddingCollection, whose tables and initial "
                             "distribution the trainer redraws")


def check_tables_drawable(tables: ReferenceEmbeddingCollection, dense_sharding: str) -> None:
    """After the model is parallelized: a refusal where the dense sharding split a table other
    than by rows (each rank must hold whole rows to draw them by their place in the table), or
    nothing. Whole tables and FSDP2's and HSDP's dim-0 shards pass."""
    from torch.distributed.tensor import DTensor, Shard

    for name, weight in zip(sorted(tables.tables), table_parameters(tables)):
        if isinstance(weight, DTensor) and any(isinstance(placement, Shard) and placement.dim != 0
                                       for placement in weight.placements):
            raise GemConfigError(
                f"train.tables_each_pass = 'reinitialize': the dense sharding "
                f"{dense_sharding!r} splits feature table {name!r}'s columns across ranks "
                f"({weight.placements}); fresh rows are drawn for whole rows only (whole tables "
                "or dim-0 shards)")


def local_rows(weight: torch.Tensor) -> range:
    """The rows of the whole table that this rank holds of ``weight`` (all of them unless it
    is a DTensor)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(weight, DTensor):
        return range(weight.shape[0])
    # DTensor's own arithmetic for where a rank's part lies (the one DCP saves by), so uneven
    # shards and 2-D meshes (HSDP: replicated x sharded) need no rule of ours.
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh,
                                                          weight.placements)
    return range(offset[0], offset[0] + shape[0])


def table_parameters(tables: ReferenceEmbeddingCollection) -> list[nn.Parameter]:
    """The feature tables' weights, in a fixed order."""
    return [tables.tables[name].weight for name in sorted(tables.tables)]


@torch.no_grad()
def reinitialize_tables(tables: ReferenceEmbeddingCollection, optimizer: torch.optim.Optimizer,
                        *, seed: int, passes: int, offsets: Sequence[torch.Tensor] = ()) -> None:
    """Draw the tables' rows anew for the pass after ``passes`` completed ones and zero their
    optimizer state (module docstring); ``offsets`` (``model.id_bias``'s, which start at 0) are
    zeroed with their state."""
    weights = table_parameters(tables)
    for index, weight in enumerate(weights):
        local = local_part(weight)
        local.copy_(draw_rows(local_rows(weight), tuple(weight.shape), std=tables.init_std,
                              seed=seed, passes=passes, table=index, device=local.device,
                              dtype=local.dtype))
    for weight in offsets:
        local_part(weight).zero_()
    for weight in (*weights, *offsets):
        for key, value in optimizer.state.get(weight, {}).items():
            # A learned prior is what the ids' effects vary by, not what one pass memorised.
            if isinstance(value, torch.Tensor) and key != PRIOR:
                local_part(value).zero_()


def draw_rows(rows: range, shape: tuple[int, int], *, std: float, seed: int, passes: int,
              table: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``rows`` of table number ``table`` (in ``table_parameters``' order; ``shape``, the
    whole table's) as drawn for the pass after ``passes``: ``(len(rows), dim)`` from N(0, std),
    the same values for a row whichever range it is drawn in (each block is drawn whole)."""
    total, dim = shape
    out = torch.empty(len(rows), dim, device=device, dtype=dtype)
    generator = torch.Generator(device=device)
    for block in range(rows.start // DRAW_BLOCK_ROWS, -(-rows.stop // DRAW_BLOCK_ROWS)):
        start = block * DRAW_BLOCK_ROWS
        stop = min(start + DRAW_BLOCK_ROWS, total)
        generator.manual_seed(_block_seed(seed, passes, table, block))
        values = torch.empty(stop - start, dim, device=device, dtype=torch.float32)
        values.normal_(0.0, std, generator=generator)
        lo, hi = max(rows.start, start), min(rows.stop, stop)
        out[lo - rows.start:hi - rows.start] = values[lo - start:hi - start]
    return out


def _block_seed(seed: int, passes: int, table: int, block: int) -> int:
    """A generator seed for one block, well mixed from its coordinates (numpy's SeedSequence:
    the same on every rank, process and Python version)."""
    import numpy as np

    words = np.random.SeedSequence([seed, passes, table, block, _STREAM]).generate_state(2)
    return int(words[0]) << 32 | int(words[1])
