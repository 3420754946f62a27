"""Raw ids to table rows: the per-table id policies of :class:`~gem_core.schema.EmbeddingTable`.

Production ids are 64-bit hashes (uint64 on disk, carried as int64 with the same bits). The
``hash`` policy mixes all 64 bits with splitmix64's finalizer (Steele, Lea and Flood 2014), then
takes the result, read as an unsigned 64-bit number, modulo the table size: stable across runs,
machines and processes (no per-process seed, unlike Python's ``hash``), and ids that differ in
any bit land on unrelated rows. The arithmetic is done in int64 with wrap-around multiplication
and masked (logical) right shifts, which is the same bit pattern as uint64 arithmetic.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from gem_core.schema import EmbeddingTable

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
    raise ValueError(f"table {table.name!r}: unknown id policy {table.id_policy!r}")


def map_ids_numpy(ids: np.ndarray, table: EmbeddingTable) -> np.ndarray:
    """:func:`map_ids` for numpy arrays (the data tools' collision report)."""
    return map_ids(torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)), table).numpy()


def collision_report(ids: np.ndarray, table: EmbeddingTable) -> dict[str, float | int]:
    """How the distinct raw ids of ``ids`` share rows of ``table`` under its policy: distinct
    ids, rows used, ids that share a row with another id, and that share as a rate."""
    distinct = np.unique(np.asarray(ids, dtype=np.int64))
    rows = map_ids_numpy(distinct, table)
    used, counts = np.unique(rows, return_counts=True)
    colliding = int(counts[counts > 1].sum())
    return {"distinct_ids": int(distinct.size), "rows_used": int(used.size),
            "colliding_ids": colliding,
            "collision_rate": colliding / distinct.size if distinct.size else 0.0}
