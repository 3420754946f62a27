"""Per-id logit offsets of candidate features (``model.id_bias``): the first-order "wide" terms
of a logistic regression, one learned number per id and task, added to every task's logit.

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
never saw keeps offset 0, the prior's mean.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gem_core.batch import JaggedBatch
from gem_core.ids import map_ids
from gem_core.schema import FeatureSchema

if TYPE_CHECKING:
    from gem_core.config import ModelConfig

__all__ = ["IdBias", "check_id_bias_features", "id_bias_parameters", "model_schema"]


def check_id_bias_features(names: Sequence[str], schema: FeatureSchema) -> None:
    """Refuse ``model.id_bias`` names that are not single-valued candidate features of the data
    whose table maps raw ids to rows itself (``managed`` tables get their rows from the
    embedding backend's remapper, which these offsets do not share)."""
    declared = {feature.name: feature for feature in schema.candidate_features}
    unknown = [name for name in names if name not in declared]
    if unknown:
        raise ValueError(f"model.id_bias names {unknown}, which the data does not declare as "
                         f"candidate features; it declares {sorted(declared)}")
    if len(set(names)) != len(names):
        raise ValueError(f"model.id_bias names a feature twice: {list(names)}")
    for name in names:
        feature = declared[name]
        if feature.multi_valued:
            raise ValueError(f"model.id_bias: candidate feature {name!r} is multi-valued; an "
                             "offset per id needs one id per candidate")
        table = schema.table(feature.table)
        if table.id_policy == "managed":
            raise ValueError(
                f"model.id_bias: candidate feature {name!r} indexes table {table.name!r}, whose "
                "id_policy 'managed' gets its rows from the embedding backend's remapper; give "
                "the table id_policy 'hash' (or 'modulo', 'dense') to use it here")


class IdBias(nn.Module):
    """One ``(rows, tasks)`` parameter of offsets per named candidate feature, rows as the feature's
    own table maps its raw ids (hash, modulo or dense); ``forward`` gives the ``(N, tasks)``
    sum of the candidates' offsets."""

    def __init__(self, names: Sequence[str], schema: FeatureSchema, num_tasks: int) -> None:
        super().__init__()
        check_id_bias_features(names, schema)
        features = {feature.name: feature for feature in schema.candidate_features}
        self.features = list(names)
        self._tables = {name: schema.table(features[name].table) for name in names}
        # Zeros made as zeros: no initialiser draws from the global generator, so everything
        # built after this module is drawn as in a model without it.
        self.offsets = nn.ParameterDict({
            name: nn.Parameter(torch.zeros(self._tables[name].num_embeddings, num_tasks))
            for name in names})

    def forward(self, batch: JaggedBatch) -> Tensor:
        total: Tensor | None = None
        for name in self.features:
            ids = batch.candidate_ids[name]
            assert isinstance(ids, Tensor), f"{name} is single-valued (checked at build)"
            offsets = F.embedding(map_ids(ids, self._tables[name]), self.offsets[name])
            total = offsets if total is None else total + offsets
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
        raise ValueError("model.id_bias_only leaves the id_bias features out of the tokens; "
                         "model.id_bias names none")
    check_id_bias_features(config.id_bias, schema)
    candidates = tuple(f for f in schema.candidate_features if f.name not in config.id_bias)
    if not candidates:
        raise ValueError(f"model.id_bias_only would leave the candidate no embedded feature "
                         f"(model.id_bias = {list(config.id_bias)} names all of them): keep one")
    read = {f.table for f in (*schema.event_features, *candidates, *schema.sparse_features)}
    return attrs.evolve(schema, candidate_features=candidates,
                        tables=tuple(t for t in schema.tables if t.name in read))
