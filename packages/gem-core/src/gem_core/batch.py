"""The in-memory training batch: jagged user histories plus non-sequence features and labels."""

from __future__ import annotations

from typing import Mapping

import attrs
import torch
from torch import Tensor

from gem_core.errors import GemDataError
from gem_core.jagged import Jagged, check_offsets, gather_rows, lengths_from_offsets
from gem_core.schema import FeatureSchema


@attrs.frozen(kw_only=True)
class JaggedBatch:
    """One batch of impressions. Histories are jagged: never padded to the batch maximum.

    Sequence fields share ``seq_offsets``: sample ``b``'s history is events
    ``seq_offsets[b]:seq_offsets[b + 1]``, oldest first.
    """

    seq_offsets: Tensor
    """``(B + 1,)`` int64 offsets of the history events."""

    seq_item_ids: Tensor
    """``(total_events,)`` int64 item id of each event."""

    seq_action_ids: Tensor
    """``(total_events,)`` int64 action type of each event."""

    seq_timestamps: Tensor
    """``(total_events,)`` int64 event time in seconds."""

    request_timestamps: Tensor
    """``(B,)`` int64 time of the impression in seconds (histories are older)."""

    candidate_item_ids: Tensor
    """``(B,)`` int64 item id of the candidate ad."""

    labels: Mapping[str, Tensor]
    """Per task, ``(B,)`` float32 labels in {0, 1}."""

    sparse: Mapping[str, Jagged] = attrs.field(factory=dict)
    """Per non-sequence sparse feature, multi-hot ids as a jagged ``(B rows)`` tensor."""

    candidate_sparse: Mapping[str, Tensor] = attrs.field(factory=dict)
    """Per candidate feature, ``(B,)`` int64 ids."""

    dense: Tensor | None = None
    """``(B, num_dense)`` float32 dense features, or None when the schema has none."""

    seq_dense: Tensor | None = None
    """``(total_events, seq_dense_dim)`` float32 content vectors, or None."""

    candidate_dense: Tensor | None = None
    """``(B, seq_dense_dim)`` float32 content vector of the candidate, in the same space as the
    history's, or None."""

    user_embedding: Tensor | None = None
    """``(B, user_embedding_dim)`` float32 precomputed upstream user embedding (flattened user
    tokens), or None: see :attr:`FeatureSchema.user_embedding_dim`."""

    @property
    def batch_size(self) -> int:
        return self.seq_offsets.numel() - 1

    @property
    def num_events(self) -> int:
        return int(self.seq_offsets[-1])

    def seq_lengths(self) -> Tensor:
        return lengths_from_offsets(self.seq_offsets)

    def select(self, indices: Tensor) -> JaggedBatch:
        """The samples ``indices``, in that order (used to split a global batch across ranks)."""
        indices = indices.to(torch.int64)
        offsets, event_index = gather_rows(self.seq_offsets, indices)
        return JaggedBatch(
            seq_offsets=offsets,
            seq_item_ids=self.seq_item_ids[event_index],
            seq_action_ids=self.seq_action_ids[event_index],
            seq_timestamps=self.seq_timestamps[event_index],
            request_timestamps=self.request_timestamps[indices],
            candidate_item_ids=self.candidate_item_ids[indices],
            labels={k: v[indices] for k, v in self.labels.items()},
            sparse={k: v.select(indices) for k, v in self.sparse.items()},
            candidate_sparse={k: v[indices] for k, v in self.candidate_sparse.items()},
            dense=None if self.dense is None else self.dense[indices],
            seq_dense=None if self.seq_dense is None else self.seq_dense[event_index],
            candidate_dense=None if self.candidate_dense is None else self.candidate_dense[indices],
            user_embedding=None if self.user_embedding is None else self.user_embedding[indices],
        )

    def to(self, device: torch.device | str) -> JaggedBatch:
        def move(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return JaggedBatch(
            seq_offsets=move(self.seq_offsets),
            seq_item_ids=move(self.seq_item_ids),
            seq_action_ids=move(self.seq_action_ids),
            seq_timestamps=move(self.seq_timestamps),
            request_timestamps=move(self.request_timestamps),
            candidate_item_ids=move(self.candidate_item_ids),
            labels={k: move(v) for k, v in self.labels.items()},
            sparse={k: v.to(device) for k, v in self.sparse.items()},
            candidate_sparse={k: move(v) for k, v in self.candidate_sparse.items()},
            dense=move(self.dense),
            seq_dense=move(self.seq_dense),
            candidate_dense=move(self.candidate_dense),
            user_embedding=move(self.user_embedding),
        )

    def validate(self, schema: FeatureSchema, where: str = "batch") -> None:
        """Raise GemDataError naming the feature, row and value of the first violation."""
        try:
            check_offsets(self.seq_offsets, self.seq_item_ids.numel(), f"{where}: history")
        except ValueError as error:
            raise GemDataError(str(error)) from None
        b = self.batch_size
        _check_ids(self.seq_item_ids, schema.num_items, "history item_id", where, self.seq_offsets)
        _check_ids(self.seq_action_ids, schema.num_actions, "history action", where,
                   self.seq_offsets)
        _check_ids(self.candidate_item_ids, schema.num_items, "candidate item_id", where)
        for feature in schema.sparse_features:
            if feature.name not in self.sparse:
                raise GemDataError(f"{where}: sparse feature {feature.name!r} is missing")
            bag = self.sparse[feature.name]
            _check_ids(bag.values, feature.num_embeddings, feature.name, where, bag.offsets)
        for feature in schema.candidate_features:
            if feature.name not in self.candidate_sparse:
                raise GemDataError(f"{where}: candidate feature {feature.name!r} is missing")
            _check_ids(self.candidate_sparse[feature.name], feature.num_embeddings, feature.name,
                       where)
        for task in schema.tasks:
            label = self.labels.get(task)
            if label is None or label.shape != (b,):
                raise GemDataError(f"{where}: label {task!r} missing or not of shape ({b},)")
            bad = ~((label == 0) | (label == 1))
            if bool(bad.any()):
                row = int(torch.nonzero(bad)[0])
                raise GemDataError(f"{where}: row {row}: label {task!r} = {float(label[row])}, "
                                   "expected 0 or 1")
        if schema.seq_dense_dim:
            expected = (self.num_events, schema.seq_dense_dim)
            if self.seq_dense is None or tuple(self.seq_dense.shape) != expected:
                raise GemDataError(f"{where}: history content vectors must be {expected}")
            bad = ~torch.isfinite(self.seq_dense).all(dim=1)
            if bool(bad.any()):
                event = int(torch.nonzero(bad)[0])
                row = int(torch.searchsorted(self.seq_offsets, event, right=True)) - 1
                raise GemDataError(f"{where}: row {row}: history event {event} has a non-finite "
                                   "content vector")
            if self.candidate_dense is not None:
                if tuple(self.candidate_dense.shape) != (b, schema.seq_dense_dim):
                    raise GemDataError(f"{where}: candidate content vectors must be "
                                       f"({b}, {schema.seq_dense_dim})")
                bad = ~torch.isfinite(self.candidate_dense).all(dim=1)
                if bool(bad.any()):
                    raise GemDataError(f"{where}: row {int(torch.nonzero(bad)[0])}: candidate "
                                       "content vector is not finite")
        if schema.user_embedding_dim:
            shape = (b, schema.user_embedding_dim)
            if self.user_embedding is None or tuple(self.user_embedding.shape) != shape:
                raise GemDataError(f"{where}: user embeddings must be {shape}")
            bad = ~torch.isfinite(self.user_embedding).all(dim=1)
            if bool(bad.any()):
                raise GemDataError(f"{where}: row {int(torch.nonzero(bad)[0])}: user embedding "
                                   "is not finite")
        if schema.num_dense:
            if self.dense is None or self.dense.shape != (b, schema.num_dense):
                raise GemDataError(f"{where}: dense features must be ({b}, {schema.num_dense})")
            bad = ~torch.isfinite(self.dense)
            if bool(bad.any()):
                row, col = (int(x) for x in torch.nonzero(bad)[0])
                raise GemDataError(f"{where}: row {row}: dense feature {col} = "
                                   f"{float(self.dense[row, col])} is not finite")


def _check_ids(ids: Tensor, size: int, feature: str, where: str,
               offsets: Tensor | None = None) -> None:
    bad = (ids < 0) | (ids >= size)
    if not bool(bad.any()):
        return
    position = int(torch.nonzero(bad)[0])
    row = position if offsets is None else int(torch.searchsorted(offsets, position, right=True)) - 1
    raise GemDataError(
        f"{where}: row {row}: {feature} id {int(ids[position])} is outside [0, {size}) "
        f"({int(bad.sum())} such ids in the batch)"
    )
