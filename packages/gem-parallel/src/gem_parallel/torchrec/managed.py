"""``torchrec-managed``: the reference embedding tables, with TorchRec's managed-collision
remapper (zero-collision hashing) in front of every table whose ``id_policy`` is ``managed``.

What a managed table does (:class:`gem_core.schema.EmbeddingTable`): its features reach the
embedding backend as raw 64-bit ids (:func:`gem_core.ids.map_ids` leaves them alone) and one
``MCHManagedCollisionModule`` per table (TorchRec 1.8, ``torchrec.modules.mc_modules``) turns
them into rows. In training, each lookup first records the batch's ids and inserts the new ones
(``eviction_interval = 1``: an id has its own row from the first batch it appears in), evicting
the ids the table's eviction policy picks when the table is full; then it maps every id to its
row. In evaluation (``train(False)``) it only maps: an id that holds no row gets the table's last
row, which TorchRec keeps as the shared row of ids that hold none (so ``num_embeddings - 1`` ids
are live at once). This is plain module composition, TorchRec's unsharded use of the module: the
rows are ordinary ``nn.Embedding`` weights (the ``reference`` backend's), so every dense and
embedding sharding that accepts the reference's tables accepts these.

Choices and why:

- all of a table's features are remapped in one call per forward (the candidate's ad id and each
  event's ad id share one table, so they must share one id -> row map, and one call is one
  remapper iteration);
- the remapper sees the raw id itself (no ``input_hash_func``): two distinct ids never share a
  row while both are live. TorchRec marks an empty slot with the largest int64, so that one id
  value (``2**63 - 1``) is refused with the table's name;
- ``eviction_interval`` is 1 and not an option: with a longer interval TorchRec keeps the ids
  of the pending iterations in a history buffer outside the module's state, so a checkpoint taken
  between evictions could not be resumed exactly, and new ids would wait up to an interval on the
  shared row;
- an evicted row keeps its vector, which the id that takes it starts from (TorchRec 1.8's
  managed-collision embedding collections do not reset evicted rows either);
- the remapper runs on the CPU (as TorchRec's ``MCHManagedCollisionModule`` is used unsharded):
  ids of a CUDA run go there and back.

Several ranks: ranks must agree on the map, or one id would train different rows on different
ranks. :mod:`gem_parallel.torchrec.sharding` (the ``torchrec`` embedding sharding, which declares
the ``managed_ids`` capability) gathers every rank's ids of a training lookup, in rank order, and
every rank runs its copy of the remapper on that same global batch: the copies stay identical,
and each rank takes its own slice of the rows. Other embedding shardings on several ranks are
refused at start-up (:func:`gem_core.ids.check_managed_ids`).

State: the remapper's buffers (sorted ids, their rows, the policy's counters, the iteration
counter) are persistent buffers of ``model.embeddings.remappers.<table>``, so they are in the
model's state dict and in every checkpoint (DCP), identical on every rank.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gem_core.contracts import EmbeddingBackend
from gem_core.embedding import EmbeddingTableConfig, ReferenceEmbeddingCollection
from gem_core.jagged import Jagged
from gem_core.schema import EmbeddingTable

EMPTY_SLOT = torch.iinfo(torch.int64).max
"""TorchRec's marker of an empty slot in the remapper (an id it cannot hold)."""


def _eviction_policy(table: EmbeddingTable) -> Any:
    from torchrec.modules.mc_modules import (
        DistanceLFU_EvictionPolicy,
        LFU_EvictionPolicy,
        LRU_EvictionPolicy,
    )

    if table.eviction_policy == "lru":
        return LRU_EvictionPolicy()
    if table.eviction_policy == "lfu":
        return LFU_EvictionPolicy()
    if table.eviction_policy == "distance_lfu":
        return DistanceLFU_EvictionPolicy(decay_exponent=table.eviction_decay)
    raise ValueError(f"table {table.name!r}: unknown eviction policy {table.eviction_policy!r}")


class IdRemapper(nn.Module):
    """One managed table's raw ids -> rows: TorchRec's ``MCHManagedCollisionModule`` with
    ``zch_size = num_embeddings`` (the last row is its shared row of ids that hold none)."""

    def __init__(self, table: EmbeddingTable) -> None:
        super().__init__()
        from torchrec.modules.mc_modules import MCHManagedCollisionModule

        if table.id_policy != "managed":
            raise ValueError(f"table {table.name!r} has id_policy {table.id_policy!r}, not "
                             "'managed': it has no remapper")
        self.table = table.name
        self.mch = MCHManagedCollisionModule(
            zch_size=table.num_embeddings, device=torch.device("cpu"),
            eviction_policy=_eviction_policy(table), eviction_interval=1, name=table.name)

    def _apply(self, fn: Any, recurse: bool = True) -> IdRemapper:
        # Stays on the CPU whatever the model is moved to: TorchRec allocates the remapper's
        # history buffer on the device given at construction, not on its buffers' device.
        return self

    def forward(self, ids: Tensor) -> Tensor:
        """The rows of ``ids`` (int64, any device); in training, the new ids are inserted first."""
        from torchrec.sparse.jagged_tensor import JaggedTensor

        device = ids.device
        values = ids.detach().to("cpu", torch.int64)
        if values.numel() == 0:
            return values.to(device)
        reserved = values == EMPTY_SLOT
        if bool(reserved.any()):
            raise ValueError(f"managed table {self.table!r}: id {EMPTY_SLOT} (2**63 - 1) is "
                             "TorchRec's empty-slot marker and cannot be remapped "
                             f"({int(reserved.sum())} such ids in the batch)")
        mch = self.mch
        if self.training and values.numel() > mch._input_history_buffer_size > 0:
            # TorchRec sizes the buffer that collects a batch's ids from the first batch and
            # silently skips the ids beyond it; with eviction_interval 1 it holds nothing between
            # calls, so it is rebuilt for the larger batch (-1: "size me from this batch").
            mch._input_history_buffer_size = -1
        if self.training:
            # Read the iteration from the buffer (as TorchRec does on its first call), not from
            # its Python copy: after a checkpoint is loaded into a remapper that has run (a
            # rollback, an evaluation replica), the buffer is the truth. With eviction_interval
            # 1 nothing else is carried between calls.
            mch._current_iter = -1
        lengths = torch.tensor([values.numel()], dtype=torch.int64)
        rows = mch({"ids": JaggedTensor(values=values, lengths=lengths)})["ids"].values()
        return rows.to(device)

    def live_ids(self) -> Tensor:
        """The ids that hold a row now (sorted)."""
        ids = self.mch._mch_sorted_raw_ids
        return ids[ids != EMPTY_SLOT].clone()

    def shared_row(self) -> int:
        """The row of ids that hold none."""
        return self.mch.output_size() - 1


def _gather_ids(ids: Tensor) -> tuple[Tensor, int]:
    """Every rank's ``ids`` (CPU int64) concatenated in rank order, and where this rank's start
    (collective: every rank calls it with its own ids)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    size = torch.tensor([ids.numel()], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    counts = [int(s) for s in sizes]
    padded = torch.zeros(max(counts), dtype=torch.int64)
    padded[:ids.numel()] = ids
    parts = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:n] for p, n in zip(parts, counts)]), sum(counts[:rank])


def remap_features(remappers: Mapping[str, IdRemapper],
                   tables: Mapping[str, EmbeddingTableConfig],
                   features: Mapping[str, Jagged], *, across_ranks: bool = False
                   ) -> dict[str, Jagged]:
    """``features`` with every managed table's raw ids replaced by rows: one remapper call per
    table over all of its features (in the table's feature order). ``across_ranks`` (training on
    several ranks): the remapper runs on every rank's ids together, so that every rank's copy
    makes the same insertions and evictions (see the module docstring)."""
    out = dict(features)
    for name, remapper in remappers.items():
        keys = tables[name].features
        values = [features[k].values for k in keys]
        ids = torch.cat([v.detach().to("cpu", torch.int64) for v in values])
        if across_ranks:
            everyone, start = _gather_ids(ids)
            rows = remapper(everyone)[start:start + ids.numel()]
        else:
            rows = remapper(ids)
        for key, part in zip(keys, torch.split(rows, [v.numel() for v in values])):
            out[key] = Jagged(part.to(features[key].values.device), features[key].offsets)
    return out


class ManagedEmbeddingCollection(ReferenceEmbeddingCollection):
    """The reference tables, with an :class:`IdRemapper` per managed table under
    ``remappers.<table>`` (one process, or one rank of a run whose embedding sharding replaces
    this module and takes the remappers over)."""

    accepts_managed_ids = True

    def __init__(self, tables: Sequence[EmbeddingTableConfig], init_std: float = 0.05) -> None:
        super().__init__(tables, init_std)
        self.remappers = nn.ModuleDict({t.name: IdRemapper(t.managed) for t in tables
                                        if t.managed is not None})

    def forward(self, features: Mapping[str, Jagged]) -> dict[str, Tensor]:
        return super().forward(remap_features(self.remappers, self.table_configs, features))


class ManagedEmbeddingBackend(EmbeddingBackend):
    """The ``torchrec-managed`` embedding backend."""

    def build(self, tables: Sequence[EmbeddingTableConfig]) -> nn.Module:
        return ManagedEmbeddingCollection(tables)
