"""The in-memory training batch: requests with jagged histories and jagged candidate lists."""

from __future__ import annotations

from typing import Mapping, Union

import attrs
import torch
from torch import Tensor

from gem_core.errors import GemDataError
from gem_core.jagged import Jagged, check_offsets, gather_rows, lengths_from_offsets, row_ids
from gem_core.schema import FeatureSchema, SequenceFeature

Ids = Union[Tensor, Jagged]
"""The ids of one categorical feature over a batch's events or candidates: a ``(rows,)`` int64
tensor (single-valued: one id per event or candidate) or a :class:`Jagged` with one row per event
or candidate (multi-valued)."""


def select_ids(ids: Ids, index: Tensor) -> Ids:
    """The rows ``index`` of a feature's ids (events or candidates), in that order."""
    return ids.select(index) if isinstance(ids, Jagged) else ids[index]


def ids_to(ids: Ids, device: torch.device | str) -> Ids:
    return ids.to(device) if isinstance(ids, Jagged) else ids.to(device, non_blocking=True)


@attrs.frozen(kw_only=True)
class JaggedBatch:
    """One batch of requests. Each request is a user's history (jagged: never padded to the
    batch maximum) and ``K >= 1`` candidates (jagged too), each with per-task labels.

    History fields share ``seq_offsets``: request ``r``'s events are
    ``seq_offsets[r]:seq_offsets[r + 1]``, oldest first. Candidate fields share
    ``candidate_offsets``: request ``r``'s candidates are
    ``candidate_offsets[r]:candidate_offsets[r + 1]``. A single-candidate data set is the case
    ``K = 1``. The feature dictionaries are keyed by the schema's feature names.
    """

    seq_offsets: Tensor
    """``(R + 1,)`` int64 offsets of the history events."""

    seq_timestamps: Tensor
    """``(total_events,)`` int64 event time in seconds."""

    event_ids: Mapping[str, Ids]
    """Per event feature, its raw ids for every event (``(total_events,)`` or jagged)."""

    request_timestamps: Tensor
    """``(R,)`` int64 time of the request in seconds (histories are strictly older)."""

    candidate_offsets: Tensor
    """``(R + 1,)`` int64 offsets of the candidates of each request."""

    candidate_ids: Mapping[str, Ids]
    """Per candidate feature, its raw ids for every candidate (``(N,)`` or jagged)."""

    labels: Mapping[str, Tensor]
    """Per task, ``(N,)`` float32 labels in {0, 1}: one per candidate (impression)."""

    sparse: Mapping[str, Jagged] = attrs.field(factory=dict)
    """Per context feature, multi-hot raw ids as a jagged tensor of ``R`` rows."""

    dense: Tensor | None = None
    """``(R, num_dense)`` float32 dense features, or None when the schema has none."""

    seq_dense: Tensor | None = None
    """``(total_events, seq_dense_dim)`` float32 content vectors, or None."""

    candidate_dense: Tensor | None = None
    """``(N, seq_dense_dim)`` float32 content vector of each candidate, in the same space as the
    history's, or None."""

    candidate_numeric: Tensor | None = None
    """``(N, candidate_numeric_dim)`` float32 numeric features of each candidate (an ad's price,
    a bid), or None: see :attr:`FeatureSchema.candidate_numeric_dim`."""

    user_embedding: Tensor | None = None
    """``(R, user_embedding_dim)`` float32 precomputed upstream user embedding (flattened user
    tokens), or None: see :attr:`FeatureSchema.user_embedding_dim`."""

    user_ids: Tensor | None = None
    """``(R,)`` int64 raw user id of each request, or None: groups impressions for GAUC."""

    teacher_logits: Mapping[str, Tensor] | None = None
    """Per task of :attr:`FeatureSchema.teacher_tasks`, ``(N,)`` float32 logit a distillation
    teacher gave each candidate, or None (``gem distill``: computed online or read from a data
    set written by ``gem distill-precompute``)."""

    teacher_embedding: Tensor | None = None
    """``(R, teacher_embedding_dim)`` float32 user embedding the teacher computed for each
    request, or None."""

    @property
    def batch_size(self) -> int:
        """Number of requests."""
        return self.seq_offsets.numel() - 1

    @property
    def num_events(self) -> int:
        return int(self.seq_offsets[-1])

    @property
    def num_candidates(self) -> int:
        """Number of impressions (candidates over all requests)."""
        return int(self.candidate_offsets[-1])

    def seq_lengths(self) -> Tensor:
        return lengths_from_offsets(self.seq_offsets)

    def candidate_counts(self) -> Tensor:
        """``(R,)`` candidates per request."""
        return lengths_from_offsets(self.candidate_offsets)

    def candidate_rows(self) -> Tensor:
        """``(N,)`` the request of each candidate."""
        return row_ids(self.candidate_offsets)

    def select(self, indices: Tensor) -> JaggedBatch:
        """The requests ``indices`` with their candidates, in that order (used to split a
        global batch across ranks and to cut eval batches)."""
        indices = indices.to(torch.int64)
        offsets, event_index = gather_rows(self.seq_offsets, indices)
        cand_offsets, cand_index = gather_rows(self.candidate_offsets, indices)
        return JaggedBatch(
            seq_offsets=offsets,
            seq_timestamps=self.seq_timestamps[event_index],
            event_ids={k: select_ids(v, event_index) for k, v in self.event_ids.items()},
            request_timestamps=self.request_timestamps[indices],
            candidate_offsets=cand_offsets,
            candidate_ids={k: select_ids(v, cand_index) for k, v in self.candidate_ids.items()},
            labels={k: v[cand_index] for k, v in self.labels.items()},
            sparse={k: v.select(indices) for k, v in self.sparse.items()},
            dense=None if self.dense is None else self.dense[indices],
            seq_dense=None if self.seq_dense is None else self.seq_dense[event_index],
            candidate_dense=(None if self.candidate_dense is None
                             else self.candidate_dense[cand_index]),
            candidate_numeric=(None if self.candidate_numeric is None
                               else self.candidate_numeric[cand_index]),
            user_embedding=None if self.user_embedding is None else self.user_embedding[indices],
            user_ids=None if self.user_ids is None else self.user_ids[indices],
            teacher_logits=(None if self.teacher_logits is None else
                            {k: v[cand_index] for k, v in self.teacher_logits.items()}),
            teacher_embedding=(None if self.teacher_embedding is None
                               else self.teacher_embedding[indices]),
        )

    def to(self, device: torch.device | str) -> JaggedBatch:
        def move(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return JaggedBatch(
            seq_offsets=move(self.seq_offsets),
            seq_timestamps=move(self.seq_timestamps),
            event_ids={k: ids_to(v, device) for k, v in self.event_ids.items()},
            request_timestamps=move(self.request_timestamps),
            candidate_offsets=move(self.candidate_offsets),
            candidate_ids={k: ids_to(v, device) for k, v in self.candidate_ids.items()},
            labels={k: move(v) for k, v in self.labels.items()},
            sparse={k: v.to(device) for k, v in self.sparse.items()},
            dense=move(self.dense),
            seq_dense=move(self.seq_dense),
            candidate_dense=move(self.candidate_dense),
            candidate_numeric=move(self.candidate_numeric),
            user_embedding=move(self.user_embedding),
            user_ids=move(self.user_ids),
            teacher_logits=(None if self.teacher_logits is None else
                            {k: move(v) for k, v in self.teacher_logits.items()}),
            teacher_embedding=move(self.teacher_embedding),
        )

    def validate(self, schema: FeatureSchema, where: str = "batch") -> None:
        """Raise GemDataError naming the feature, row (request) and value of the first
        violation. Ids are checked against their table only under the ``dense`` policy (other
        policies accept any 64-bit id)."""
        # In this order: the layout first, since every later check indexes by the offsets.
        self._validate_layout(where)
        self._validate_ids(schema, where)
        self._validate_labels(schema, where)
        self._validate_content(schema, where)
        self._validate_request_features(schema, where)
        self._validate_teacher(schema, where)

    def _validate_layout(self, where: str) -> None:
        """The offsets of the histories and of the candidate lists, one list per request, none
        of them empty."""
        try:
            check_offsets(self.seq_offsets, self.seq_timestamps.numel(), f"{where}: history")
            first = next(iter(self.candidate_ids.values()), None)
            total = (int(self.candidate_offsets[-1]) if first is None
                     else (first.batch_size if isinstance(first, Jagged) else first.numel()))
            check_offsets(self.candidate_offsets, total, f"{where}: candidates")
        except ValueError as error:
            raise GemDataError(str(error)) from None
        r = self.batch_size
        if self.candidate_offsets.numel() != r + 1:
            raise GemDataError(f"{where}: {self.candidate_offsets.numel() - 1} candidate lists "
                               f"for {r} requests")
        counts = self.candidate_counts()
        if bool((counts == 0).any()):
            row = int(torch.nonzero(counts == 0)[0])
            raise GemDataError(f"{where}: row {row}: the request has no candidates "
                               f"({int((counts == 0).sum())} such requests in the batch)")

    def _validate_ids(self, schema: FeatureSchema, where: str) -> None:
        """Every event, candidate and sparse feature the schema declares is present, with ids
        inside their table under the ``dense`` policy."""
        for kind, features, store, rows, offsets in (
                ("event", schema.event_features, self.event_ids, self.num_events,
                 self.seq_offsets),
                ("candidate", schema.candidate_features, self.candidate_ids, self.num_candidates,
                 self.candidate_offsets)):
            for feature in features:
                ids = store.get(feature.name)
                if ids is None:
                    raise GemDataError(f"{where}: {kind} feature {feature.name!r} is missing")
                _check_feature_ids(ids, feature, schema, kind, rows, offsets, where)
        for feature in schema.sparse_features:
            if feature.name not in self.sparse:
                raise GemDataError(f"{where}: sparse feature {feature.name!r} is missing")
            bag = self.sparse[feature.name]
            table = schema.table(feature.table)
            if table.id_policy == "dense":
                _check_ids(bag.values, table.num_embeddings, feature.name, where, bag.offsets)

    def _validate_labels(self, schema: FeatureSchema, where: str) -> None:
        """One label in {0, 1} per candidate for every task."""
        n = self.num_candidates
        for task in schema.tasks:
            label = self.labels.get(task)
            if label is None or label.shape != (n,):
                raise GemDataError(f"{where}: label {task!r} missing or not of shape ({n},) "
                                   "(one label per candidate)")
            bad = ~((label == 0) | (label == 1))
            if bool(bad.any()):
                row = _row_of(int(torch.nonzero(bad)[0]), self.candidate_offsets)
                value = float(label[torch.nonzero(bad)[0]])
                raise GemDataError(f"{where}: row {row}: label {task!r} = {value}, "
                                   "expected 0 or 1")

    def _validate_content(self, schema: FeatureSchema, where: str) -> None:
        """The content vectors of the history events and of the candidates, and the candidates'
        numeric features: shapes, and finite values."""
        e, n = self.num_events, self.num_candidates
        if schema.seq_dense_dim:
            expected = (e, schema.seq_dense_dim)
            if self.seq_dense is None or tuple(self.seq_dense.shape) != expected:
                raise GemDataError(f"{where}: history content vectors must be {expected}")
            bad = ~torch.isfinite(self.seq_dense).all(dim=1)
            if bool(bad.any()):
                event = int(torch.nonzero(bad)[0])
                raise GemDataError(f"{where}: row {_row_of(event, self.seq_offsets)}: history "
                                   f"event {event} has a non-finite content vector")
        if schema.candidate_content:
            if self.candidate_dense is None or tuple(self.candidate_dense.shape) != (
                    n, schema.seq_dense_dim):
                raise GemDataError(f"{where}: candidate content vectors must be "
                                   f"({n}, {schema.seq_dense_dim})")
            bad = ~torch.isfinite(self.candidate_dense).all(dim=1)
            if bool(bad.any()):
                row = _row_of(int(torch.nonzero(bad)[0]), self.candidate_offsets)
                raise GemDataError(f"{where}: row {row}: candidate content vector is not finite")
        if schema.candidate_numeric_dim:
            shape = (n, schema.candidate_numeric_dim)
            if self.candidate_numeric is None or tuple(self.candidate_numeric.shape) != shape:
                raise GemDataError(f"{where}: candidate numeric features must be {shape}")
            bad = ~torch.isfinite(self.candidate_numeric)
            if bool(bad.any()):
                position, column = (int(x) for x in torch.nonzero(bad)[0])
                raise GemDataError(
                    f"{where}: row {_row_of(position, self.candidate_offsets)}: candidate "
                    f"{position}'s numeric feature {column} = "
                    f"{float(self.candidate_numeric[position, column])} is not finite")

    def _validate_request_features(self, schema: FeatureSchema, where: str) -> None:
        """What each request carries once: the upstream user embedding, the dense features and
        the user id."""
        r = self.batch_size
        if schema.user_embedding_dim:
            shape = (r, schema.user_embedding_dim)
            if self.user_embedding is None or tuple(self.user_embedding.shape) != shape:
                raise GemDataError(f"{where}: user embeddings must be {shape}")
            bad = ~torch.isfinite(self.user_embedding).all(dim=1)
            if bool(bad.any()):
                raise GemDataError(f"{where}: row {int(torch.nonzero(bad)[0])}: user embedding "
                                   "is not finite")
        if schema.num_dense:
            if self.dense is None or self.dense.shape != (r, schema.num_dense):
                raise GemDataError(f"{where}: dense features must be ({r}, {schema.num_dense})")
            bad = ~torch.isfinite(self.dense)
            if bool(bad.any()):
                row, col = (int(x) for x in torch.nonzero(bad)[0])
                raise GemDataError(f"{where}: row {row}: dense feature {col} = "
                                   f"{float(self.dense[row, col])} is not finite")
        if self.user_ids is not None and self.user_ids.shape != (r,):
            raise GemDataError(f"{where}: user ids must be ({r},)")

    def _validate_teacher(self, schema: FeatureSchema, where: str) -> None:
        """The teacher's signals the schema declares: shapes, and finite values."""
        n, r = self.num_candidates, self.batch_size
        for task in schema.teacher_tasks:
            logits = None if self.teacher_logits is None else self.teacher_logits.get(task)
            if logits is None or logits.shape != (n,):
                raise GemDataError(f"{where}: teacher logit {task!r} missing or not of shape "
                                   f"({n},) (one per candidate)")
            bad = ~torch.isfinite(logits)
            if bool(bad.any()):
                row = _row_of(int(torch.nonzero(bad)[0]), self.candidate_offsets)
                raise GemDataError(f"{where}: row {row}: teacher logit {task!r} is not finite")
        if schema.teacher_embedding_dim:
            shape = (r, schema.teacher_embedding_dim)
            if self.teacher_embedding is None or tuple(self.teacher_embedding.shape) != shape:
                raise GemDataError(f"{where}: teacher embeddings must be {shape}")
            bad = ~torch.isfinite(self.teacher_embedding).all(dim=1)
            if bool(bad.any()):
                raise GemDataError(f"{where}: row {int(torch.nonzero(bad)[0])}: teacher "
                                   "embedding is not finite")


def _row_of(position: int, offsets: Tensor) -> int:
    """The request that value ``position`` of a jagged field with ``offsets`` belongs to."""
    return int(torch.searchsorted(offsets, position, right=True)) - 1


def _check_feature_ids(ids: Ids, feature: SequenceFeature, schema: FeatureSchema, kind: str,
                       rows: int, offsets: Tensor, where: str) -> None:
    name = f"{kind} {feature.name}"
    if feature.multi_valued:
        if not isinstance(ids, Jagged) or ids.batch_size != rows:
            raise GemDataError(f"{where}: {name} is multi-valued: expected ids jagged over "
                               f"{rows} {kind}s")
        try:
            check_offsets(ids.offsets, ids.values.numel(), f"{where}: {name}")
        except ValueError as error:
            raise GemDataError(str(error)) from None
        empty = ids.lengths() == 0
        if bool(empty.any()):
            position = int(torch.nonzero(empty)[0])
            raise GemDataError(
                f"{where}: row {_row_of(position, offsets)}: {name} is empty for {kind} "
                f"{position} ({int(empty.sum())} such {kind}s in the batch); every {kind} needs "
                "at least one id")
        values = ids.values
        value_rows = (row_ids(ids.offsets) if values.numel() else values)
    else:
        if isinstance(ids, Jagged) or ids.shape != (rows,):
            raise GemDataError(f"{where}: {name} is single-valued: expected ({rows},) ids")
        values, value_rows = ids, None
    table = schema.table(feature.table)
    if table.id_policy != "dense":
        return
    bad = (values < 0) | (values >= table.num_embeddings)
    if not bool(bad.any()):
        return
    position = int(torch.nonzero(bad)[0])
    owner = position if value_rows is None else int(value_rows[position])
    raise GemDataError(
        f"{where}: row {_row_of(owner, offsets)}: {name} id {int(values[position])} is outside "
        f"[0, {table.num_embeddings}) of table {table.name!r} ({int(bad.sum())} such ids in the "
        "batch)")


def _check_ids(ids: Tensor, size: int, feature: str, where: str,
               offsets: Tensor | None = None) -> None:
    bad = (ids < 0) | (ids >= size)
    if not bool(bad.any()):
        return
    position = int(torch.nonzero(bad)[0])
    row = (position if offsets is None
           else int(torch.searchsorted(offsets, position, right=True)) - 1)
    raise GemDataError(
        f"{where}: row {row}: {feature} id {int(ids[position])} is outside [0, {size}) "
        f"({int(bad.sum())} such ids in the batch)"
    )
