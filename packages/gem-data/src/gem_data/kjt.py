"""Conversion between :class:`~gem_core.batch.JaggedBatch` and TorchRec's ``KeyedJaggedTensor``.

The KJT carries every id feature (keys below, each with ``B`` lengths, key-major as TorchRec lays
them out); the float parts (labels, dense features, request times) travel beside it as
:class:`KJTExtras`. Going back checks what TorchRec's own validator lets through: negative
lengths, offsets that go backwards, lengths that do not sum to the values, and a lengths vector
whose size does not match keys x batch. torchrec is imported only when these functions run.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs
import torch
from torch import Tensor

from gem_core.batch import JaggedBatch
from gem_core.errors import GemDataError
from gem_core.jagged import Jagged, offsets_from_lengths
from gem_core.schema import FeatureSchema

from gem_data import format as fmt


@attrs.frozen(kw_only=True)
class KJTExtras:
    """The non-id parts of a batch, carried beside its KeyedJaggedTensor."""

    request_timestamps: Tensor
    labels: Mapping[str, Tensor]
    dense: Tensor | None = None
    seq_dense: Tensor | None = None


def kjt_keys(schema: FeatureSchema) -> list[str]:
    """KJT keys of a schema's id features, in order."""
    return ([fmt.HISTORY_ITEM, fmt.HISTORY_ACTION, fmt.HISTORY_TIMESTAMP]
            + [fmt.sparse_column(f.name) for f in schema.sparse_features]
            + [fmt.CANDIDATE_ITEM]
            + [fmt.candidate_column(f.name) for f in schema.candidate_features])


def to_kjt(batch: JaggedBatch, schema: FeatureSchema) -> tuple[Any, KJTExtras]:
    """``(KeyedJaggedTensor, extras)`` holding ``batch``; candidates are length-1 features."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    seq_lengths = batch.seq_lengths()
    ones = torch.ones(batch.batch_size, dtype=torch.int64)
    parts = [(batch.seq_item_ids, seq_lengths), (batch.seq_action_ids, seq_lengths),
             (batch.seq_timestamps, seq_lengths)]
    parts += [(batch.sparse[f.name].values, batch.sparse[f.name].lengths())
              for f in schema.sparse_features]
    parts += [(batch.candidate_item_ids, ones)]
    parts += [(batch.candidate_sparse[f.name], ones) for f in schema.candidate_features]
    kjt = KeyedJaggedTensor(
        keys=kjt_keys(schema),
        values=torch.cat([v for v, _ in parts]),
        lengths=torch.cat([n for _, n in parts]),
    )
    extras = KJTExtras(request_timestamps=batch.request_timestamps, labels=dict(batch.labels),
                       dense=batch.dense, seq_dense=batch.seq_dense)
    return kjt, extras


def from_kjt(kjt: Any, extras: KJTExtras, schema: FeatureSchema) -> JaggedBatch:
    """The JaggedBatch of a KJT made by :func:`to_kjt` (or by anyone with the same keys)."""
    keys = list(kjt.keys())
    expected = kjt_keys(schema)
    missing = [k for k in expected if k not in keys]
    if missing:
        raise GemDataError(f"KeyedJaggedTensor lacks keys {missing}; it has {keys}")
    b = extras.request_timestamps.numel()
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
                           f"x batch {b} (expected {len(keys) * b})")
    negative = torch.nonzero(lengths < 0)
    if negative.numel():
        position = int(negative[0])
        raise GemDataError(f"KeyedJaggedTensor: feature {keys[position // b]!r} row "
                           f"{position % b}: length {int(lengths[position])} is negative")
    if int(lengths.sum()) != values.numel():
        raise GemDataError(f"KeyedJaggedTensor: lengths sum to {int(lengths.sum())} but there "
                           f"are {values.numel()} values")
    per_key = lengths.view(len(keys), b)
    chunks = torch.split(values, per_key.sum(dim=1).tolist())
    features = {key: (chunk, per_key[i]) for i, (key, chunk) in enumerate(zip(keys, chunks))}

    history_lengths = features[fmt.HISTORY_ITEM][1]
    for key in (fmt.HISTORY_ACTION, fmt.HISTORY_TIMESTAMP):
        bad = torch.nonzero(features[key][1] != history_lengths)
        if bad.numel():
            row = int(bad[0])
            raise GemDataError(f"KeyedJaggedTensor: feature {key!r} row {row}: length "
                               f"{int(features[key][1][row])} differs from {fmt.HISTORY_ITEM!r} "
                               f"length {int(history_lengths[row])}")

    def single(key: str) -> Tensor:
        ids, lens = features[key]
        bad = torch.nonzero(lens != 1)
        if bad.numel():
            row = int(bad[0])
            raise GemDataError(f"KeyedJaggedTensor: feature {key!r} row {row}: candidate "
                               f"features need exactly one id, got {int(lens[row])}")
        return ids

    return JaggedBatch(
        seq_offsets=offsets_from_lengths(history_lengths),
        seq_item_ids=features[fmt.HISTORY_ITEM][0],
        seq_action_ids=features[fmt.HISTORY_ACTION][0],
        seq_timestamps=features[fmt.HISTORY_TIMESTAMP][0],
        request_timestamps=extras.request_timestamps,
        candidate_item_ids=single(fmt.CANDIDATE_ITEM),
        labels=dict(extras.labels),
        sparse={f.name: Jagged(features[fmt.sparse_column(f.name)][0],
                               offsets_from_lengths(features[fmt.sparse_column(f.name)][1]))
                for f in schema.sparse_features},
        candidate_sparse={f.name: single(fmt.candidate_column(f.name))
                          for f in schema.candidate_features},
        dense=extras.dense,
        seq_dense=extras.seq_dense,
    )
