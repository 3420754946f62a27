"""Per-id logit offsets of candidate and request features (``model.id_bias``): the first-order
"wide" terms of a logistic regression, one learned number per id and task, added to every task's
logit: an ad's effect (``adgroup_id``), a user's (a sparse ``user_id`` feature of the request).

Why a module of its own rather than the candidate's embedding: an ad with six impressions in a
pass (the Taobao-shaped log of docs/results.md) has about 0.3 clicks. Its embedding row is read
through the interaction and stepped by AdamW, whose update has about the same size for a
non-click (gradient ``p``, near 0.05) as for a click (``p - 1``, near -0.95): for rare ids
AdamW is close to sign descent and cannot weigh the evidence. The offsets here are stepped by
plain SGD at a rate per impression (:mod:`gem_core.train.table_optimizer`,
:func:`id_bias_group`): after ``n`` impressions an offset has moved by ``rate * sum(y - p)``,
the online form of a per-id regression under a Gaussian prior whose variance is about
``rate`` (the posterior mean while ``rate * n * p (1 - p)`` is small).

The offsets start at zero, so a model with them starts as without them. An id the training
never saw keeps offset 0, the prior's mean. A request's offsets reach each of its impressions,
so a user's offset is stepped by ``rate * sum(y - p)`` over the user's impressions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gem_core.batch import JaggedBatch
from gem_core.errors import GemConfigError
from gem_core.ids import map_ids
from gem_core.schema import ContextFeature, FeatureSchema, SequenceFeature

if TYPE_CHECKING:
    from gem_core.config import ModelConfig

__all__ = ["IdBias", "IdBiasFeature", "check_id_bias_features", "id_bias_parameters",
           "model_schema"]


@attrs.frozen
class IdBiasFeature:
    """A feature ``model.id_bias`` names, resolved against the data's schema."""

    name: str
    """As named: ``adgroup_id``, or with its kind, ``candidate.adgroup_id`` / ``sparse.user_id``
    (needed only where the schema declares the name as both)."""

    kind: str
    """``candidate`` (one id per impression) or ``sparse`` (the request's bag of ids)."""

    feature: SequenceFeature | ContextFeature

    @property
    def key(self) -> str:
        """The offsets' key in the module's state (a parameter name cannot hold a dot)."""
        return self.name.replace(".", "__")


def check_id_bias_features(names: Sequence[str], schema: FeatureSchema) -> list[IdBiasFeature]:
    """Resolve ``model.id_bias``'s names to the data's features, refusing a name that is not a
    candidate feature (single-valued) or a request's sparse feature, a name given twice, and a
    feature whose table gets its rows from the embedding backend (``managed``), which these
    offsets do not share."""
    kinds = {"candidate": {f.name: f for f in schema.candidate_features},
             "sparse": {f.name: f for f in schema.sparse_features}}
    resolved: list[IdBiasFeature] = []
    for name in names:
        kind, _, bare = name.rpartition(".")
        if kind and kind not in kinds:
            raise GemConfigError(f"model.id_bias: {name!r}: the kind before the dot must be "
                                 f"'candidate' or 'sparse', not {kind!r}")
        found = [k for k in ([kind] if kind else kinds) if bare in kinds[k]]
        if not found:
            raise GemConfigError(
                f"model.id_bias names {[name]}, which the data does not declare as candidate "
                f"features or sparse (request) features; it declares candidate features "
                f"{sorted(kinds['candidate'])} and sparse features {sorted(kinds['sparse'])}")
        if len(found) > 1:
            raise GemConfigError(f"model.id_bias: the data declares {name!r} both as a candidate "
                                 f"feature and as a sparse feature: name 'candidate.{name}' or "
                                 f"'sparse.{name}'")
        resolved.append(IdBiasFeature(name=name, kind=found[0], feature=kinds[found[0]][bare]))
    seen = [(f.kind, f.feature.name) for f in resolved]
    if len(set(seen)) != len(seen):
        raise GemConfigError(f"model.id_bias names a feature twice: {list(names)}")
    for item in resolved:
        if item.kind == "candidate" and item.feature.multi_valued:
            raise GemConfigError(f"model.id_bias: candidate feature {item.name!r} is "
                                 "multi-valued; an offset per id needs one id per candidate")
        table = schema.table(item.feature.table)
        if table.id_policy == "managed":
            raise GemConfigError(
                f"model.id_bias: {item.kind} feature {item.name!r} indexes table {table.name!r}, "
                "whose id_policy 'managed' gets its rows from the embedding backend's remapper; "
                "give the table id_policy 'hash' (or 'modulo', 'dense') to use it here")
    return resolved


class IdBias(nn.Module):
    """One ``(rows, tasks)`` parameter of offsets per named feature, rows as the feature's own
    table maps its raw ids (hash, modulo or dense); ``forward`` gives the ``(N, tasks)`` sum of
    each impression's offsets: its candidate's, and its request's (a sparse feature's bag pooled
    as the feature declares, ``sum`` or ``mean``)."""

    def __init__(self, names: Sequence[str], schema: FeatureSchema, num_tasks: int) -> None:
        super().__init__()
        self._features = check_id_bias_features(names, schema)
        self.features = list(names)
        self._tables = {f.key: schema.table(f.feature.table) for f in self._features}
        # Zeros made as zeros: no initialiser draws from the global generator, so everything
        # built after this module is drawn as in a model without it.
        self.offsets = nn.ParameterDict({
            f.key: nn.Parameter(torch.zeros(self._tables[f.key].num_embeddings, num_tasks))
            for f in self._features})

    def forward(self, batch: JaggedBatch) -> Tensor:
        total: Tensor | None = None
        request_total: Tensor | None = None
        for item in self._features:
            table, weight = self._tables[item.key], self.offsets[item.key]
            if item.kind == "candidate":
                ids = batch.candidate_ids[item.feature.name]
                assert isinstance(ids, Tensor), f"{item.name} is single-valued (checked at build)"
                offsets = F.embedding(map_ids(ids, table), weight)
                total = offsets if total is None else total + offsets
            else:
                assert isinstance(item.feature, ContextFeature)
                bag = batch.sparse[item.feature.name]
                pooled = F.embedding_bag(map_ids(bag.values, table), weight, bag.offsets,
                                         mode=item.feature.pooling, include_last_offset=True)
                request_total = pooled if request_total is None else request_total + pooled
        if request_total is not None:
            per_impression = request_total[batch.candidate_rows()]
            total = per_impression if total is None else total + per_impression
        assert total is not None
        return total

    def extra_repr(self) -> str:
        return f"features={self.features}"


def id_bias_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The offsets' parameters among ``module``'s (wrapped or not: matched by module type)."""
    return [param for sub in module.modules() if isinstance(sub, IdBias)
            for param in sub.parameters()]


def model_schema(config: ModelConfig, schema: FeatureSchema) -> FeatureSchema:
    """The features the model embeds: the data's, less the ``id_bias`` features when
    ``id_bias_only`` (they reach the model through their offsets alone), and less the tables no
    remaining feature reads (never built). The data's batches still carry those features' ids;
    the offsets read them there."""
    if not config.id_bias_only:
        return schema
    if not config.id_bias:
        raise GemConfigError("model.id_bias_only leaves the id_bias features out of the tokens; "
                             "model.id_bias names none")
    named = {(f.kind, f.feature.name) for f in check_id_bias_features(config.id_bias, schema)}
    candidates = tuple(f for f in schema.candidate_features if ("candidate", f.name) not in named)
    if not candidates:
        raise GemConfigError(f"model.id_bias_only would leave the candidate no embedded "
                             f"feature (model.id_bias = {list(config.id_bias)} names all of "
                             "them): keep one")
    sparse = tuple(f for f in schema.sparse_features if ("sparse", f.name) not in named)
    read = {f.table for f in (*schema.event_features, *candidates, *sparse)}
    return attrs.evolve(schema, candidate_features=candidates, sparse_features=sparse,
                        tables=tuple(t for t in schema.tables if t.name in read))
