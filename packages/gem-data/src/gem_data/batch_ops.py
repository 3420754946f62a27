"""Slicing and concatenating request-level JaggedBatch objects (what the loader needs besides
``select``). Event fields follow ``seq_offsets``, candidate fields ``candidate_offsets``; a
multi-valued feature's ids are a Jagged over events (or candidates) and move with them."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

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


def _cat_jagged(parts: Sequence[Jagged]) -> Jagged:
    return Jagged(torch.cat([p.values for p in parts]), _cat_offsets([p.offsets for p in parts]))


def _cat_ids(parts: Sequence[Any]) -> Any:
    return _cat_jagged(parts) if isinstance(parts[0], Jagged) else torch.cat(list(parts))


def concat_batches(batches: Sequence[JaggedBatch]) -> JaggedBatch:
    """The requests of ``batches`` in order, as one batch."""
    if len(batches) == 1:
        return batches[0]
    first = batches[0]
    return JaggedBatch(
        seq_offsets=_cat_offsets([b.seq_offsets for b in batches]),
        seq_timestamps=torch.cat([b.seq_timestamps for b in batches]),
        event_ids={k: _cat_ids([b.event_ids[k] for b in batches]) for k in first.event_ids},
        request_timestamps=torch.cat([b.request_timestamps for b in batches]),
        candidate_offsets=_cat_offsets([b.candidate_offsets for b in batches]),
        candidate_ids={k: _cat_ids([b.candidate_ids[k] for b in batches])
                       for k in first.candidate_ids},
        labels={k: torch.cat([b.labels[k] for b in batches]) for k in first.labels},
        sparse={k: _cat_jagged([b.sparse[k] for b in batches]) for k in first.sparse},
        dense=_opt_cat([b.dense for b in batches]),
        seq_dense=_opt_cat([b.seq_dense for b in batches]),
        candidate_dense=_opt_cat([b.candidate_dense for b in batches]),
        candidate_numeric=_opt_cat([b.candidate_numeric for b in batches]),
        user_embedding=_opt_cat([b.user_embedding for b in batches]),
        user_ids=_opt_cat([b.user_ids for b in batches]),
        teacher_logits=(None if first.teacher_logits is None else
                        {k: torch.cat([b.teacher_logits[k] for b in batches])
                         for k in first.teacher_logits}),
        teacher_embedding=_opt_cat([b.teacher_embedding for b in batches]),
    )


def _slice_jagged(bag: Jagged, start: int, stop: int) -> Jagged:
    lo, hi = int(bag.offsets[start]), int(bag.offsets[stop])
    return Jagged(bag.values[lo:hi], bag.offsets[start:stop + 1] - lo)


def _slice_ids(ids: Any, start: int, stop: int) -> Any:
    return _slice_jagged(ids, start, stop) if isinstance(ids, Jagged) else ids[start:stop]


def slice_batch(batch: JaggedBatch, start: int, stop: int) -> JaggedBatch:
    """Requests ``start:stop`` as views of ``batch``'s buffers (no copy of the values)."""
    e_lo, e_hi = int(batch.seq_offsets[start]), int(batch.seq_offsets[stop])
    c_lo, c_hi = int(batch.candidate_offsets[start]), int(batch.candidate_offsets[stop])

    def rows(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[start:stop]

    return JaggedBatch(
        seq_offsets=batch.seq_offsets[start:stop + 1] - e_lo,
        seq_timestamps=batch.seq_timestamps[e_lo:e_hi],
        event_ids={k: _slice_ids(v, e_lo, e_hi) for k, v in batch.event_ids.items()},
        request_timestamps=batch.request_timestamps[start:stop],
        candidate_offsets=batch.candidate_offsets[start:stop + 1] - c_lo,
        candidate_ids={k: _slice_ids(v, c_lo, c_hi) for k, v in batch.candidate_ids.items()},
        labels={k: v[c_lo:c_hi] for k, v in batch.labels.items()},
        sparse={k: _slice_jagged(v, start, stop) for k, v in batch.sparse.items()},
        dense=rows(batch.dense),
        seq_dense=None if batch.seq_dense is None else batch.seq_dense[e_lo:e_hi],
        candidate_dense=(None if batch.candidate_dense is None
                         else batch.candidate_dense[c_lo:c_hi]),
        candidate_numeric=(None if batch.candidate_numeric is None
                           else batch.candidate_numeric[c_lo:c_hi]),
        user_embedding=rows(batch.user_embedding),
        user_ids=rows(batch.user_ids),
        teacher_logits=(None if batch.teacher_logits is None else
                        {k: v[c_lo:c_hi] for k, v in batch.teacher_logits.items()}),
        teacher_embedding=rows(batch.teacher_embedding),
    )


class RowGather:
    """Gathers requests of one large batch many times (the loader's shuffled window): the per-row
    starts and lengths are computed once, so each gather costs O(requests + events and
    candidates taken), not O(window) as a generic ``select`` does."""

    def __init__(self, batch: JaggedBatch) -> None:
        self.batch = batch
        self._seq = _starts_lengths(batch.seq_offsets)
        self._cand = _starts_lengths(batch.candidate_offsets)
        self._sparse = {k: _starts_lengths(v.offsets) for k, v in batch.sparse.items()}
        self._event_multi = {k: _starts_lengths(v.offsets) for k, v in batch.event_ids.items()
                             if isinstance(v, Jagged)}
        self._cand_multi = {k: _starts_lengths(v.offsets)
                            for k, v in batch.candidate_ids.items() if isinstance(v, Jagged)}

    @staticmethod
    def _ids(store: Mapping[str, Any], multi: Mapping[str, tuple[np.ndarray, np.ndarray]],
             index: np.ndarray) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, ids in store.items():
            if isinstance(ids, Jagged):
                offsets, value_index = _gather_index(*multi[name], index)
                out[name] = Jagged(_take(ids.values, value_index), torch.from_numpy(offsets))
            else:
                out[name] = _take(ids, index)
        return out

    def take(self, indices: np.ndarray) -> JaggedBatch:
        # numpy's take, not torch indexing: torch's advanced indexing goes through its
        # intra-op thread pool and ran 10-100x slower per batch on busy 2-core machines.
        b = self.batch
        seq_offsets, seq_index = _gather_index(*self._seq, indices)
        cand_offsets, cand_index = _gather_index(*self._cand, indices)
        sparse = {}
        for name, bag in b.sparse.items():
            offsets, index = _gather_index(*self._sparse[name], indices)
            sparse[name] = Jagged(_take(bag.values, index), torch.from_numpy(offsets))

        def rows(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else _take(t, indices)

        return JaggedBatch(
            seq_offsets=torch.from_numpy(seq_offsets),
            seq_timestamps=_take(b.seq_timestamps, seq_index),
            event_ids=self._ids(b.event_ids, self._event_multi, seq_index),
            request_timestamps=_take(b.request_timestamps, indices),
            candidate_offsets=torch.from_numpy(cand_offsets),
            candidate_ids=self._ids(b.candidate_ids, self._cand_multi, cand_index),
            labels={k: _take(v, cand_index) for k, v in b.labels.items()},
            sparse=sparse,
            dense=rows(b.dense),
            seq_dense=None if b.seq_dense is None else _take(b.seq_dense, seq_index),
            candidate_dense=(None if b.candidate_dense is None
                             else _take(b.candidate_dense, cand_index)),
            candidate_numeric=(None if b.candidate_numeric is None
                               else _take(b.candidate_numeric, cand_index)),
            user_embedding=rows(b.user_embedding),
            user_ids=rows(b.user_ids),
            teacher_logits=(None if b.teacher_logits is None else
                            {k: _take(v, cand_index) for k, v in b.teacher_logits.items()}),
            teacher_embedding=rows(b.teacher_embedding),
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
    """``batch`` with each request's history cut to the events at or before ``cutoff[row]``
    (what an upstream model that ran at that time saw). Histories are oldest first, so what is
    kept is a prefix of each row; every event feature (multi-valued ones too) and ``seq_dense``
    are cut alike."""
    rows = torch.repeat_interleave(torch.arange(batch.batch_size), batch.seq_lengths())
    keep = batch.seq_timestamps <= cutoff[rows]
    kept = torch.zeros(batch.batch_size, dtype=torch.int64).index_add_(0, rows, keep.long())
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(kept, 0)])
    index = torch.nonzero(keep).flatten()
    return attrs.evolve(
        batch, seq_offsets=offsets, seq_timestamps=batch.seq_timestamps[keep],
        event_ids={k: (v.select(index) if isinstance(v, Jagged) else v[keep])
                   for k, v in batch.event_ids.items()},
        seq_dense=None if batch.seq_dense is None else batch.seq_dense[keep])
