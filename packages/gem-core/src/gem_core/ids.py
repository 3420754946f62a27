"""Raw ids to table rows: the per-table id policies of :class:`~gem_core.schema.EmbeddingTable`.

Production ids are 64-bit hashes (uint64 on disk, carried as int64 with the same bits). The
``hash`` policy mixes all 64 bits with splitmix64's finalizer (Steele, Lea and Flood 2014), then
takes the result, read as an unsigned 64-bit number, modulo the table size: stable across runs,
machines and processes (no per-process seed, unlike Python's ``hash``), and ids that differ in
any bit land on unrelated rows. The arithmetic is done in int64 with wrap-around multiplication
and masked (logical) right shifts, which is the same bit pattern as uint64 arithmetic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from gem_core.capabilities import MANAGED_IDS
from gem_core.errors import GemConfigError
from gem_core.schema import EmbeddingTable, FeatureSchema

if TYPE_CHECKING:
    from gem_core.plugins import GemPlugins
    from gem_core.registry import ImplementationSpec

_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_TWO64 = 1 << 64


def _signed(value: int) -> int:
    """The int64 with the bits of the uint64 ``value``."""
    return value - _TWO64 if value >= 1 << 63 else value


def _shift_right_logical(x: Tensor, bits: int) -> Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(ids: Tensor) -> Tensor:
    """splitmix64's output for each int64 id (bits as uint64), as int64 with the same bits."""
    z = ids.to(torch.int64) + _signed(_GOLDEN)
    z = (z ^ _shift_right_logical(z, 30)) * _signed(_MIX1)
    z = (z ^ _shift_right_logical(z, 27)) * _signed(_MIX2)
    return z ^ _shift_right_logical(z, 31)


def unsigned_mod(x: Tensor, size: int) -> Tensor:
    """``x`` read as uint64, modulo ``size`` (``0 < size < 2**62``), exactly, in int64."""
    # x as uint64 = (x mod 2^64); split off the sign bit: u = hi * 2^63 + lo with lo >= 0.
    lo = x & ((1 << 63) - 1)
    hi = (x < 0).to(torch.int64)
    return (lo % size + hi * ((1 << 63) % size)) % size


def map_ids(ids: Tensor, table: EmbeddingTable) -> Tensor:
    """The rows of ``table`` that the raw ``ids`` of one of its features index."""
    if table.id_policy == "dense":
        return ids
    if table.id_policy == "modulo":
        return unsigned_mod(ids.to(torch.int64), table.num_embeddings)
    if table.id_policy == "hash":
        return unsigned_mod(splitmix64(ids), table.num_embeddings)
    if table.id_policy == "managed":
        return ids  # raw: the embedding backend's remapper assigns the rows
    raise ValueError(f"table {table.name!r}: unknown id policy {table.id_policy!r}")


def map_ids_numpy(ids: np.ndarray, table: EmbeddingTable) -> np.ndarray:
    """:func:`map_ids` for numpy arrays (the data tools' collision report); a ``managed`` table's
    rows depend on training, so it has no fixed mapping to give."""
    if table.id_policy == "managed":
        raise ValueError(f"table {table.name!r}: managed ids get their rows while training "
                         "(the embedding backend's remapper); there is no fixed id -> row map")
    return map_ids(torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)), table).numpy()


def collision_report(ids: np.ndarray, table: EmbeddingTable) -> dict[str, float | int]:
    """How the distinct raw ids of ``ids`` share rows of ``table`` under its policy: distinct
    ids, rows used, ids that share a row with another id, and that share as a rate.

    A ``managed`` table gives every live id a row of its own: no two ids share a row at once.
    What it reports instead is how many distinct ids exceed the ``num_embeddings - 1`` rows it
    keeps live (``over_capacity_ids``): at least that many evictions over a pass of the data."""
    distinct = np.unique(np.asarray(ids, dtype=np.int64))
    if table.id_policy == "managed":
        live = table.num_embeddings - 1
        return {"distinct_ids": int(distinct.size), "rows_used": min(int(distinct.size), live),
                "colliding_ids": 0, "collision_rate": 0.0,
                "over_capacity_ids": max(int(distinct.size) - live, 0)}
    rows = map_ids_numpy(distinct, table)
    used, counts = np.unique(rows, return_counts=True)
    colliding = int(counts[counts > 1].sum())
    return {"distinct_ids": int(distinct.size), "rows_used": int(used.size),
            "colliding_ids": colliding,
            "collision_rate": colliding / distinct.size if distinct.size else 0.0}


def check_managed_ids(schema: FeatureSchema, *, embedding: ImplementationSpec,
                      embedding_sharding: ImplementationSpec, world_size: int,
                      plugins: GemPlugins) -> None:
    """At start-up: refuse, naming the table and what to choose instead, a run whose ``managed``
    tables the chosen embedding backend cannot remap (it must declare :data:`MANAGED_IDS`), or
    whose ranks would remap ids each on its own (several ranks need an embedding sharding that
    declares it: replicated remappers fed different batches would give one id different rows)."""
    managed = [t.name for t in schema.tables if t.id_policy == "managed"]
    if not managed:
        return
    tables = ", ".join(repr(name) for name in managed)

    def offering(kind: str) -> str:
        names = [s.name for s in plugins.registry(kind).specs() if MANAGED_IDS in s.capabilities]
        return ", ".join(names) or "none is installed (gem-parallel provides them)"

    if MANAGED_IDS not in embedding.capabilities:
        raise GemConfigError(
            f"table(s) {tables} have id_policy 'managed', which the embedding backend "
            f"{embedding.name!r} does not handle (it maps no raw ids to rows); choose one that "
            f"does with --set backends.embedding=NAME: {offering('embedding')}")
    if world_size > 1 and MANAGED_IDS not in embedding_sharding.capabilities:
        raise GemConfigError(
            f"table(s) {tables} have id_policy 'managed' and this run has {world_size} ranks: "
            f"with embedding sharding {embedding_sharding.name!r} every rank would remap the ids "
            f"of its own batches and one id would get different rows on different ranks; use "
            f"--embedding-sharding {offering('embedding_sharding')}")
