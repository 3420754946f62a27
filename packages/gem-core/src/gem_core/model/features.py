"""From a batch's raw ids to vectors, following the data set's declared schema.

Every categorical feature travels to the embedding backend as a jagged tensor of one row per
**request** (the stride TorchRec's KeyedJaggedTensor needs for all keys alike), under its
:func:`~gem_core.schema.feature_key`: an event feature's row holds the ids of all the request's
events, a candidate feature's row those of all its candidates. Event and candidate tables are
looked up unpooled (one vector per id); multi-valued features are then pooled per event or per
candidate here, so an event feature and a candidate feature can share one table (the candidate's
ad id and each event's ad id). Context tables are pooled by the backend, one vector per request.

An event's token is the **sum** of its features' vectors (and a candidate's the sum of its
features'): a sum keeps the width at ``embedding_dim`` whatever the number of features and lets
a candidate and an event that share attributes align from the first step; interactions between
attributes are left to the layers above.
"""

from __future__ import annotations

from typing import Mapping

import attrs
from torch import Tensor, nn

from gem_core.batch import Ids, JaggedBatch
from gem_core.embedding import EmbeddingTableConfig
from gem_core.ids import map_ids
from gem_core.jagged import Jagged, row_ids
from gem_core.schema import FeatureSchema, SequenceFeature, feature_key


def embedding_tables(dim: int, schema: FeatureSchema) -> list[EmbeddingTableConfig]:
    """One table per declared table, with the keys of every feature that indexes it."""
    keys: dict[str, list[str]] = {t.name: [] for t in schema.tables}
    pooling: dict[str, str] = {}
    for kind, feature in schema.id_features():
        keys[feature.table].append(feature_key(kind, feature.name))
        if kind == "context":
            previous = pooling.setdefault(feature.table, feature.pooling)
            if previous != feature.pooling:
                raise ValueError(f"context features of table {feature.table!r} disagree on "
                                 f"pooling ({previous} and {feature.pooling})")
    return [EmbeddingTableConfig(name=t.name, num_embeddings=t.num_embeddings, dim=dim,
                                 pooling=pooling.get(t.name, "none"), features=tuple(keys[t.name]),
                                 managed=t if t.id_policy == "managed" else None)
            for t in schema.tables]


@attrs.frozen
class LookedUp:
    """The vectors of one batch: summed per event and per candidate, one per context feature."""

    events: Tensor
    """``(total_events, d)`` sum of each event's feature vectors."""

    candidates: Tensor
    """``(N, d)`` sum of each candidate's feature vectors."""

    context: list[Tensor]
    """Per context feature (schema order), ``(R, d)``."""

    event_vectors: dict[str, Tensor] = attrs.field(factory=dict)
    """Per event feature, ``(total_events, d)``: each event's vector of that feature alone
    (multi-valued ones pooled), the parts of ``events``."""

    candidate_vectors: dict[str, Tensor] = attrs.field(factory=dict)
    """Per candidate feature, ``(N, d)``: the parts of ``candidates``."""


def _request_rows(ids: Ids, offsets: Tensor, multi_valued: bool) -> Jagged:
    """The feature's ids as one jagged row per request: ``offsets`` cut events (or candidates)
    into requests; a multi-valued feature's value offsets are read at those cuts."""
    if multi_valued:
        assert isinstance(ids, Jagged)
        return Jagged(ids.values, ids.offsets[offsets])
    return Jagged(ids, offsets)


def pool_rows(vectors: Tensor, offsets: Tensor, mode: str) -> Tensor:
    """``(rows, d)`` sum or mean of the vectors of each jagged row (rows are non-empty)."""
    rows = offsets.numel() - 1
    pooled = vectors.new_zeros(rows, vectors.shape[1]).index_add_(0, row_ids(offsets), vectors)
    if mode == "mean":
        counts = (offsets[1:] - offsets[:-1]).clamp(min=1).to(vectors.dtype)
        pooled = pooled / counts.unsqueeze(1)
    return pooled


class FeatureLookup:
    """Maps raw ids by each table's id policy (a ``managed`` table's ids go on raw: the
    embedding backend's remapper assigns their rows), looks them up on the backend, pools
    multi-valued features and sums each event's (and candidate's) feature vectors. Holds no
    parameters: the embedding module stays the model's own ``embeddings`` attribute, which the
    parallel plugins replace (TorchRec) and checkpoints name."""

    def __init__(self, schema: FeatureSchema) -> None:
        self.schema = schema

    def inputs(self, batch: JaggedBatch) -> dict[str, Jagged]:
        """What the embedding backend receives: every feature's table rows, one jagged row per
        request, under its feature key."""
        schema = self.schema
        out: dict[str, Jagged] = {}
        for features, store, offsets, kind in (
                (schema.event_features, batch.event_ids, batch.seq_offsets, "event"),
                (schema.candidate_features, batch.candidate_ids, batch.candidate_offsets,
                 "candidate")):
            for feature in features:
                rows = _request_rows(store[feature.name], offsets, feature.multi_valued)
                out[feature_key(kind, feature.name)] = Jagged(
                    map_ids(rows.values, schema.table(feature.table)), rows.offsets)
        for feature in schema.sparse_features:
            bag = batch.sparse[feature.name]
            out[feature.name] = Jagged(map_ids(bag.values, schema.table(feature.table)),
                                       bag.offsets)
        return out

    def __call__(self, embeddings: nn.Module, batch: JaggedBatch) -> LookedUp:
        vectors = embeddings(self.inputs(batch))
        event_vectors = self._per_feature(self.schema.event_features, batch.event_ids, vectors,
                                          "event")
        candidate_vectors = self._per_feature(self.schema.candidate_features,
                                              batch.candidate_ids, vectors, "candidate")
        return LookedUp(events=_sum(event_vectors), candidates=_sum(candidate_vectors),
                        context=[vectors[f.name] for f in self.schema.sparse_features],
                        event_vectors=event_vectors, candidate_vectors=candidate_vectors)

    @staticmethod
    def _per_feature(features: tuple[SequenceFeature, ...], store: Mapping[str, Ids],
                     vectors: Mapping[str, Tensor], kind: str) -> dict[str, Tensor]:
        """One vector per event (or candidate) and feature, multi-valued ones pooled."""
        out = {}
        for feature in features:
            value = vectors[feature_key(kind, feature.name)]
            if feature.multi_valued:
                value = pool_rows(value, store[feature.name].offsets, feature.pooling)
            out[feature.name] = value
        return out


def _sum(per_feature: Mapping[str, Tensor]) -> Tensor:
    values = list(per_feature.values())
    assert values  # the schema declares at least one feature of each kind
    total = values[0]
    for value in values[1:]:
        total = total + value
    return total
