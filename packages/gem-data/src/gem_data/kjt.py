"""Conversion between :class:`~gem_core.batch.JaggedBatch` and TorchRec's ``KeyedJaggedTensor``.

The KJT holds what the embedding backend receives
(:meth:`gem_core.model.features.FeatureLookup.inputs`): one key per categorical feature, named by
:func:`gem_core.schema.feature_key` (``event.<name>``, ``candidate.<name>``, the context feature's
name), each with **one row per request** (the stride TorchRec needs for all keys alike): an event
feature's row holds the ids of all the request's events, a candidate feature's those of all its
candidates, a multi-valued feature's every id of every event. By default the values are table
rows (each table's id policy applied, as the model sees them); ``map_ids=False`` keeps the raw
ids. What the KJT cannot hold travels beside it as :class:`KJTExtras`: the event and candidate
offsets, the per-event (per-candidate) offsets of multi-valued features, timestamps, labels and
the float features.

Going back checks what TorchRec's own validator lets through: negative lengths, offsets that go
backwards, lengths that do not sum to the values, a lengths vector whose size does not match keys
x requests, and per-request lengths that disagree with the history or the candidates. torchrec is
imported only when these functions run.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs
import torch
from torch import Tensor

from gem_core.batch import JaggedBatch
from gem_core.errors import GemDataError
from gem_core.jagged import Jagged
from gem_core.model.features import FeatureLookup
from gem_core.schema import FeatureSchema, feature_key


@attrs.frozen(kw_only=True)
class KJTExtras:
    """The parts of a batch a KeyedJaggedTensor does not carry."""

    seq_offsets: Tensor
    seq_timestamps: Tensor
    request_timestamps: Tensor
    candidate_offsets: Tensor
    labels: Mapping[str, Tensor]
    item_offsets: Mapping[str, Tensor] = attrs.field(factory=dict)
    """Per multi-valued feature key, the offsets of each event's (candidate's) ids."""
    dense: Tensor | None = None
    seq_dense: Tensor | None = None
    candidate_dense: Tensor | None = None
    candidate_numeric: Tensor | None = None
    user_embedding: Tensor | None = None
    user_ids: Tensor | None = None
    teacher_logits: Mapping[str, Tensor] | None = None
    teacher_embedding: Tensor | None = None


def kjt_keys(schema: FeatureSchema) -> list[str]:
    """KJT keys of a schema's categorical features, in :meth:`FeatureSchema.id_features` order
    (the order of ``FeatureLookup.inputs``)."""
    return [feature_key(kind, feature.name) for kind, feature in schema.id_features()]


def _raw_inputs(batch: JaggedBatch, schema: FeatureSchema) -> dict[str, Jagged]:
    out: dict[str, Jagged] = {}
    for kind, feature in schema.id_features():
        key = feature_key(kind, feature.name)
        if kind == "context":
            out[key] = batch.sparse[feature.name]
            continue
        store, offsets = ((batch.event_ids, batch.seq_offsets) if kind == "event"
                          else (batch.candidate_ids, batch.candidate_offsets))
        ids = store[feature.name]
        out[key] = (Jagged(ids.values, ids.offsets[offsets]) if isinstance(ids, Jagged)
                    else Jagged(ids, offsets))
    return out


def to_kjt(batch: JaggedBatch, schema: FeatureSchema, *, map_ids: bool = True
           ) -> tuple[Any, KJTExtras]:
    """``(KeyedJaggedTensor, extras)`` holding ``batch``; values are table rows (``map_ids``) or
    the raw ids."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    inputs = FeatureLookup(schema).inputs(batch) if map_ids else _raw_inputs(batch, schema)
    keys = kjt_keys(schema)
    parts = [inputs[k] for k in keys]
    kjt = KeyedJaggedTensor(
        keys=keys,
        values=torch.cat([p.values for p in parts]),
        lengths=torch.cat([p.lengths() for p in parts]),
    )
    item_offsets = {}
    for kind, feature in schema.id_features():
        if kind != "context" and getattr(feature, "multi_valued", False):
            store = batch.event_ids if kind == "event" else batch.candidate_ids
            item_offsets[feature_key(kind, feature.name)] = store[feature.name].offsets
    extras = KJTExtras(
        seq_offsets=batch.seq_offsets, seq_timestamps=batch.seq_timestamps,
        request_timestamps=batch.request_timestamps, candidate_offsets=batch.candidate_offsets,
        labels=dict(batch.labels), item_offsets=item_offsets, dense=batch.dense,
        seq_dense=batch.seq_dense, candidate_dense=batch.candidate_dense,
        candidate_numeric=batch.candidate_numeric,
        user_embedding=batch.user_embedding, user_ids=batch.user_ids,
        teacher_logits=batch.teacher_logits, teacher_embedding=batch.teacher_embedding)
    return kjt, extras


def from_kjt(kjt: Any, extras: KJTExtras, schema: FeatureSchema) -> JaggedBatch:
    """The JaggedBatch of a KJT made by :func:`to_kjt` (or by anyone with the same keys); its
    ids are the KJT's values (table rows if it was made with ``map_ids``)."""
    keys = list(kjt.keys())
    b = extras.request_timestamps.numel()
    _check_layout(kjt, extras, schema, keys, b)
    values, lengths = kjt.values(), kjt.lengths()
    per_key = lengths.view(len(keys), b)
    chunks = torch.split(values, per_key.sum(dim=1).tolist())
    features = {key: (chunk, per_key[i]) for i, (key, chunk) in enumerate(zip(keys, chunks))}
    event_ids, candidate_ids, sparse = {}, {}, {}
    for kind, feature in schema.id_features():
        key = feature_key(kind, feature.name)
        if kind == "event":
            event_ids[feature.name] = _item_ids(features, extras, key, extras.seq_offsets,
                                                "request's history length")
        elif kind == "candidate":
            candidate_ids[feature.name] = _item_ids(features, extras, key,
                                                    extras.candidate_offsets,
                                                    "request's candidate count")
        else:
            chunk, lens = features[key]
            bag_offsets = torch.zeros(b + 1, dtype=torch.int64)
            torch.cumsum(lens.to(torch.int64), 0, out=bag_offsets[1:])
            sparse[feature.name] = Jagged(chunk, bag_offsets)
    return JaggedBatch(
        seq_offsets=extras.seq_offsets,
        seq_timestamps=extras.seq_timestamps,
        event_ids=event_ids,
        request_timestamps=extras.request_timestamps,
        candidate_offsets=extras.candidate_offsets,
        candidate_ids=candidate_ids,
        labels=dict(extras.labels),
        sparse=sparse,
        dense=extras.dense,
        seq_dense=extras.seq_dense,
        candidate_dense=extras.candidate_dense,
        candidate_numeric=extras.candidate_numeric,
        user_embedding=extras.user_embedding,
        user_ids=extras.user_ids,
        teacher_logits=extras.teacher_logits,
        teacher_embedding=extras.teacher_embedding,
    )


def _check_layout(kjt: Any, extras: KJTExtras, schema: FeatureSchema, keys: list[str],
                  b: int) -> None:
    """What TorchRec's own validator lets through, before the KJT is cut into features: every
    key the schema needs, extras for ``b`` requests, offsets that never go backwards, one
    non-negative length per key and request, lengths that sum to the values."""
    expected = kjt_keys(schema)
    missing = [k for k in expected if k not in keys]
    if missing:
        raise GemDataError(f"KeyedJaggedTensor lacks keys {missing}; it has {keys}")
    if extras.seq_offsets.numel() != b + 1 or extras.candidate_offsets.numel() != b + 1:
        raise GemDataError(f"KJT extras: {b} requests but {extras.seq_offsets.numel() - 1} "
                           f"histories and {extras.candidate_offsets.numel() - 1} candidate lists")
    values = kjt.values()
    offsets = kjt.offsets() if kjt.offsets_or_none() is not None else None
    if offsets is not None and offsets.numel() > 1:
        backwards = torch.nonzero(offsets[1:] < offsets[:-1])
        if backwards.numel():
            position = int(backwards[0])
            key, row = keys[position // max(b, 1)], position % max(b, 1)
            raise GemDataError(f"KeyedJaggedTensor: feature {key!r} row {row}: offsets go "
                               f"backwards ({int(offsets[position])} -> "
                               f"{int(offsets[position + 1])})")
    lengths = kjt.lengths()
    if lengths.numel() != len(keys) * b:
        raise GemDataError(f"KeyedJaggedTensor: {lengths.numel()} lengths for {len(keys)} keys "
                           f"x {b} requests (expected {len(keys) * b})")
    negative = torch.nonzero(lengths < 0)
    if negative.numel():
        position = int(negative[0])
        raise GemDataError(f"KeyedJaggedTensor: feature {keys[position // b]!r} row "
                           f"{position % b}: length {int(lengths[position])} is negative")
    if int(lengths.sum()) != values.numel():
        raise GemDataError(f"KeyedJaggedTensor: lengths sum to {int(lengths.sum())} but there "
                           f"are {values.numel()} values")


def _item_ids(features: dict[str, tuple[Tensor, Tensor]], extras: KJTExtras, key: str,
              rows: Tensor, what: str) -> Any:
    """An event (candidate) feature's ids per event (candidate), after checking its
    per-request lengths against ``rows`` (the history or candidate offsets; ``what`` words
    them): a tensor, or a Jagged with the offsets of a multi-valued feature's ids."""
    chunk, lens = features[key]
    inner = extras.item_offsets.get(key)
    expected = (inner[rows] if inner is not None else rows)
    expected = expected[1:] - expected[:-1]
    bad = torch.nonzero(lens != expected)
    if bad.numel():
        row = int(bad[0])
        raise GemDataError(f"KeyedJaggedTensor: feature {key!r} row {row}: length "
                           f"{int(lens[row])} differs from the {what} "
                           f"({int(expected[row])} ids)")
    return Jagged(chunk, inner) if inner is not None else chunk
