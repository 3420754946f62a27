"""The feature schema: what a GEM training example holds, and the id-space of every feature."""

from __future__ import annotations

import attrs

_positive = attrs.validators.gt(0)


def _unique_names(instance: object, attribute: attrs.Attribute, value: tuple) -> None:
    names = [feature.name for feature in value]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"{attribute.name} names must be unique, repeated: {', '.join(duplicates)}")


@attrs.frozen(kw_only=True)
class SparseFeature:
    """A categorical feature with an id space: multi-hot per sample, or one id for a candidate."""

    name: str
    """Feature name, also the name of its embedding table."""

    num_embeddings: int = attrs.field(validator=_positive)
    """Size of the id space: valid ids are ``0 .. num_embeddings - 1``."""

    pooling: str = attrs.field(default="sum", validator=attrs.validators.in_(("sum", "mean")))
    """How a multi-hot bag is reduced to one vector."""


@attrs.frozen(kw_only=True)
class FeatureSchema:
    """Every feature a batch carries. Data sources declare it; the model is built from it."""

    num_items: int = attrs.field(validator=_positive)
    """Id space shared by history item ids and the candidate's item id."""

    num_actions: int = attrs.field(validator=_positive)
    """Id space of the per-event action type (view, click, conversion, ...)."""

    sparse_features: tuple[SparseFeature, ...] = attrs.field(
        default=(), converter=tuple, validator=_unique_names
    )
    """Non-sequence multi-hot features of the user or context, pooled into one vector each."""

    candidate_features: tuple[SparseFeature, ...] = attrs.field(
        default=(), converter=tuple, validator=_unique_names
    )
    """Single-id features of the candidate ad besides its item id (advertiser, category, ...)."""

    num_dense: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """Number of dense float features per sample."""

    seq_dense_dim: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """Width of the optional dense content vector of each history event (0: none)."""

    tasks: tuple[str, ...] = attrs.field(default=("click", "conversion"), converter=tuple)
    """Binary label names, one prediction head each."""

    candidate_content: bool = False
    """The candidate carries a content vector in the history's space (``seq_dense_dim`` floats,
    ``JaggedBatch.candidate_dense``)."""

    user_embedding_dim: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """Width of a precomputed user embedding carried by each sample (0: none). Set by data sets
    exported with ``gem export-user-embeddings``: the upstream tower's output, so a downstream
    ranker can train and evaluate without running the tower."""

    max_seq_len: int = attrs.field(default=1024, validator=_positive)
    """Longest history the data holds (after truncation to the most recent events)."""
