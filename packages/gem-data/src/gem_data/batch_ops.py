"""Slicing and concatenating JaggedBatch objects (what the loader needs besides ``select``)."""

from __future__ import annotations

from typing import Sequence

import attrs
import numpy as np
import torch

from gem_core.batch import JaggedBatch
from gem_core.jagged import Jagged


def _opt_cat(parts: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    return None if parts[0] is None else torch.cat(list(parts))


def _cat_offsets(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Offsets of rows laid back to back: each part shifted by the values before it."""
    shifted, base = [parts[0].new_zeros(1)], 0
    for offsets in parts:
        shifted.append(offsets[1:] + base)
        base += int(offsets[-1])
    return torch.cat(shifted)


def concat_batches(batches: Sequence[JaggedBatch]) -> JaggedBatch:
    """The rows of ``batches`` in order, as one batch."""
    if len(batches) == 1:
        return batches[0]
    first = batches[0]
    return JaggedBatch(
        seq_offsets=_cat_offsets([b.seq_offsets for b in batches]),
        seq_item_ids=torch.cat([b.seq_item_ids for b in batches]),
        seq_action_ids=torch.cat([b.seq_action_ids for b in batches]),
        seq_timestamps=torch.cat([b.seq_timestamps for b in batches]),
        request_timestamps=torch.cat([b.request_timestamps for b in batches]),
        candidate_item_ids=torch.cat([b.candidate_item_ids for b in batches]),
        labels={k: torch.cat([b.labels[k] for b in batches]) for k in first.labels},
        sparse={k: Jagged(torch.cat([b.sparse[k].values for b in batches]),
                          _cat_offsets([b.sparse[k].offsets for b in batches]))
                for k in first.sparse},
        candidate_sparse={k: torch.cat([b.candidate_sparse[k] for b in batches])
                          for k in first.candidate_sparse},
        dense=_opt_cat([b.dense for b in batches]),
        seq_dense=_opt_cat([b.seq_dense for b in batches]),
        candidate_dense=_opt_cat([b.candidate_dense for b in batches]),
        user_embedding=_opt_cat([b.user_embedding for b in batches]),
    )


def _slice_jagged(values: torch.Tensor, offsets: torch.Tensor, start: int,
                  stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    lo, hi = int(offsets[start]), int(offsets[stop])
    return values[lo:hi], offsets[start:stop + 1] - lo


def slice_batch(batch: JaggedBatch, start: int, stop: int) -> JaggedBatch:
    """Rows ``start:stop`` as views of ``batch``'s buffers (no copy of the values)."""
    seq_lo, seq_hi = int(batch.seq_offsets[start]), int(batch.seq_offsets[stop])
    sparse = {}
    for name, bag in batch.sparse.items():
        values, offsets = _slice_jagged(bag.values, bag.offsets, start, stop)
        sparse[name] = Jagged(values, offsets)
    return JaggedBatch(
        seq_offsets=batch.seq_offsets[start:stop + 1] - seq_lo,
        seq_item_ids=batch.seq_item_ids[seq_lo:seq_hi],
        seq_action_ids=batch.seq_action_ids[seq_lo:seq_hi],
        seq_timestamps=batch.seq_timestamps[seq_lo:seq_hi],
        request_timestamps=batch.request_timestamps[start:stop],
        candidate_item_ids=batch.candidate_item_ids[start:stop],
        labels={k: v[start:stop] for k, v in batch.labels.items()},
        sparse=sparse,
        candidate_sparse={k: v[start:stop] for k, v in batch.candidate_sparse.items()},
        dense=None if batch.dense is None else batch.dense[start:stop],
        seq_dense=None if batch.seq_dense is None else batch.seq_dense[seq_lo:seq_hi],
        candidate_dense=(None if batch.candidate_dense is None
                         else batch.candidate_dense[start:stop]),
        user_embedding=(None if batch.user_embedding is None
                        else batch.user_embedding[start:stop]),
    )


class RowGather:
    """Gathers rows of one large batch many times (the loader's shuffled window): the per-row
    starts and lengths are computed once, so each gather costs O(rows + events taken), not
    O(window) as a generic ``select`` does."""

    def __init__(self, batch: JaggedBatch) -> None:
        self.batch = batch
        self._seq = _starts_lengths(batch.seq_offsets)
        self._sparse = {k: _starts_lengths(v.offsets) for k, v in batch.sparse.items()}

    def take(self, indices: np.ndarray) -> JaggedBatch:
        # numpy's take, not torch indexing: torch's advanced indexing goes through its
        # intra-op thread pool and ran 10-100x slower per batch on busy 2-core machines.
        b = self.batch
        seq_offsets, seq_index = _gather_index(*self._seq, indices)
        sparse = {}
        for name, bag in b.sparse.items():
            offsets, index = _gather_index(*self._sparse[name], indices)
            sparse[name] = Jagged(_take(bag.values, index), torch.from_numpy(offsets))
        return JaggedBatch(
            seq_offsets=torch.from_numpy(seq_offsets),
            seq_item_ids=_take(b.seq_item_ids, seq_index),
            seq_action_ids=_take(b.seq_action_ids, seq_index),
            seq_timestamps=_take(b.seq_timestamps, seq_index),
            request_timestamps=_take(b.request_timestamps, indices),
            candidate_item_ids=_take(b.candidate_item_ids, indices),
            labels={k: _take(v, indices) for k, v in b.labels.items()},
            sparse=sparse,
            candidate_sparse={k: _take(v, indices) for k, v in b.candidate_sparse.items()},
            dense=None if b.dense is None else _take(b.dense, indices),
            seq_dense=None if b.seq_dense is None else _take(b.seq_dense, seq_index),
            candidate_dense=(None if b.candidate_dense is None
                             else _take(b.candidate_dense, indices)),
            user_embedding=(None if b.user_embedding is None
                            else _take(b.user_embedding, indices)),
        )


def _take(tensor: torch.Tensor, index: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.take(tensor.numpy(), index, axis=0))


def _starts_lengths(offsets: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    o = offsets.numpy()
    return o[:-1], np.diff(o)


def _gather_index(starts: np.ndarray, lengths: np.ndarray,
                  indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Offsets of rows ``indices`` laid back to back, and the value positions that form them."""
    taken = lengths[indices]
    offsets = np.zeros(indices.size + 1, dtype=np.int64)
    np.cumsum(taken, out=offsets[1:])
    shift = np.repeat(starts[indices] - offsets[:-1], taken)
    return offsets, np.arange(int(offsets[-1])) + shift


def events_before(batch: JaggedBatch, cutoff: torch.Tensor) -> JaggedBatch:
    """``batch`` with each row's history cut to the events at or before ``cutoff[row]`` (what
    an upstream model that ran at that time saw). Histories are oldest first, so what is kept is
    a prefix of each row."""
    rows = torch.repeat_interleave(torch.arange(batch.batch_size), batch.seq_lengths())
    keep = batch.seq_timestamps <= cutoff[rows]
    kept = torch.zeros(batch.batch_size, dtype=torch.int64).index_add_(0, rows, keep.long())
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(kept, 0)])
    return attrs.evolve(
        batch, seq_offsets=offsets, seq_item_ids=batch.seq_item_ids[keep],
        seq_action_ids=batch.seq_action_ids[keep], seq_timestamps=batch.seq_timestamps[keep],
        seq_dense=None if batch.seq_dense is None else batch.seq_dense[keep])
