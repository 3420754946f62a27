"""The backends the model calls (kinds ``attention``, ``norm`` and ``embedding``): jagged
attention, the gated norm around it, and the builder of the embedding tables."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from torch import Tensor, nn

    from gem_core.attention.api import AttentionParams
    from gem_core.attention.relative_bias import RelativeBias
    from gem_core.embedding_tables import EmbeddingTableConfig


class AttentionBackend(abc.ABC):
    """A jagged attention implementation (kind ``attention``).

    ``q``: ``(total_q, heads, head_dim)`` with ``q_offsets`` ``(batch + 1,)``; ``k``, ``v``:
    ``(total_kv, heads, head_dim)`` with ``kv_offsets``. Returns ``(total_q, heads, head_dim)`` in
    ``q.dtype``. ``num_targets`` ``(batch,)`` counts target tokens at the tail of each sequence
    (self-attention only). ``max_q_len``/``max_kv_len`` are upper bounds a kernel may use to size
    its grid without a device sync. A sample with no keys outputs zeros. Gradients for q, k and
    v flow when its registration declares ``supports_backward``. It computes the same
    function as the reference backend (:mod:`gem_core.attention.reference`) and passes
    :class:`gem_core.testing.AttentionConformance`.

    What it supports beyond the required call is declared as data in its registration's
    ``capabilities``, names of :data:`gem_core.capabilities.ATTENTION_CAPABILITIES` (each one's
    docstring there says what declaring it means): the normalisations it computes and its
    optional features. ``bias=RelativeBias(...)`` is added to ``scale * q.k`` before the
    normalisation, with gradients for its weights. A run checks the declaration at start-up
    against what it asks for. Given a bias or a normalisation it does not declare, a backend
    raises (NotImplementedError naming it); it never computes something else.
    """

    @abc.abstractmethod
    def __call__(self, q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, kv_offsets: Tensor,
                 *, params: AttentionParams, num_targets: Tensor | None = None,
                 max_q_len: int | None = None, max_kv_len: int | None = None,
                 bias: RelativeBias | None = None) -> Tensor:
        """Attention of ``q`` over ``k``/``v`` per sample, as described above."""


class NormBackend(abc.ABC):
    """A gated-norm implementation (kind ``norm``): ``(norm(x) * weight + bias) * gate`` over the
    last dimension, in ``x.dtype``, with gradients for x, gate, weight and bias, as
    :func:`gem_core.norm.gated_norm_reference`; it passes :class:`gem_core.testing.NormConformance`.
    """

    @abc.abstractmethod
    def gated_norm(self, x: Tensor, gate: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                   kind: str = "layer", eps: float = 1e-5) -> Tensor:
        """``kind``: ``layer`` (LayerNorm) or ``rms`` (RMSNorm)."""


class EmbeddingBackend(abc.ABC):
    """Builds the model's embedding tables (kind ``embedding``)."""

    @abc.abstractmethod
    def build(self, tables: Sequence[EmbeddingTableConfig]) -> nn.Module:
        """A module whose ``forward(features: Mapping[str, Jagged]) -> dict[str, Tensor]`` looks
        up every table's features: pooled tables give ``(batch, dim)``, unpooled ones
        ``(total_ids, dim)``. Ids outside ``[0, num_embeddings)`` raise an error naming the table
        and the id."""
