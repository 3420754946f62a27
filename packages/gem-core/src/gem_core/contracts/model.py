"""What the trainer relies on in a model (kind ``model``): :class:`RankingModel` for the
training loop and :class:`StrategyModel` for the strategies that transform it, with the kinds of
parts the latter answers for (:data:`CHECKPOINT_KINDS`, :data:`STASH_KINDS`) and helpers for
implementations."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Callable, Mapping

from gem_core.errors import GemConfigError

if TYPE_CHECKING:
    from torch import Tensor, nn


class RankingModel(abc.ABC):
    """What the training loop asks of a model (mix it into an ``nn.Module``). Its interface to
    the strategies that transform it is :class:`StrategyModel`."""

    @abc.abstractmethod
    def flops(self, lengths: Tensor, candidates: Tensor | None = None) -> Mapping[str, int]:
        """Training FLOPs of one batch of requests with these history lengths and candidates
        per request: ``total``, ``attention``, ``padded_total``, ``padded_attention``."""

    def auxiliary_losses(self) -> dict[str, Tensor]:
        """Losses of the last training forward to add to the training loss (e.g. MoE load
        balancing), each a mean over this rank's rows; none by default."""
        return {}

    def impression_loss_sums(self) -> dict[str, Tensor]:
        """Losses of the last training forward with one term per impression (weighted), each
        *summed* over this rank's impressions; none by default. The trainer divides them by the
        global batch's impressions as it does the task losses, so one rank and several train
        the same loss whatever share of the batch each holds."""
        return {}

    def step_stats(self) -> dict[str, float]:
        """Additive per-step counts of the last training forward, summed across ranks by the
        trainer and then passed to :meth:`summarize_step_stats`; none by default."""
        return {}

    def summarize_step_stats(self, summed: dict[str, float]) -> dict[str, Any]:
        """Metrics for ``metrics.jsonl`` from :meth:`step_stats` summed over ranks."""
        return dict(summed)


CHECKPOINT_KINDS = ("block", "attention", "mlp")
"""Kinds :meth:`StrategyModel.checkpoint_parts` answers: ``block`` (what a ``full`` policy
recomputes whole), ``attention`` (the attention kernel calls), ``mlp`` (the feed-forward parts)."""

STASH_KINDS = ("linear", "norm", "swiglu", "sequence_block", "target_attention", "pma",
               "cross_attention", "interaction")
"""Kinds :meth:`StrategyModel.stash_points` answers (the FP8 activation stash's
``activation_modules``)."""


class StrategyModel(abc.ABC):
    """The interface of a model to the strategies that transform it (mix it into an
    ``nn.Module``: ``class MyModel(nn.Module, StrategyModel)``).

    Dense sharding (FSDP2 units), activation checkpointing, expert parallelism and the FP8
    activation stash ask the model through these methods which of its modules to wrap,
    recompute, shard or hook; they never walk its attribute layout and never import its classes.
    A model that does not subclass it is refused by name (:func:`require_strategy_model`). The
    methods are queried when a strategy applies, after earlier steps may have swapped modules
    (precision conversion replaces linear layers, embedding sharding replaces ``embeddings``), so
    an implementation computes its answers from the current module tree.

    ``embeddings``: the module holding the sparse embedding tables, as the embedding backend
    built it (``embedding_backend.build(tables)``). Embedding sharding strategies replace this
    attribute with their sharded module (same forward); the forward must read the tables only
    through it, and the model's other parameters are the dense ones.
    """

    embeddings: nn.Module

    @abc.abstractmethod
    def parallel_units(self) -> list[nn.Module]:
        """The repeated blocks of the model, in forward order. FSDP2-style strategies make each
        its own unit (its parameters gathered just before it runs and freed after) and give
        every remaining parameter to the root; none may contain another. An empty list (a model
        too small to be worth it) makes the whole model one unit, deliberately."""

    @abc.abstractmethod
    def checkpoint_parts(self, kind: str) -> list[tuple[nn.Module, str]]:
        """What an activation-checkpointing policy may recompute for ``kind`` (one of
        :data:`CHECKPOINT_KINDS`), in forward order: ``(owner, attribute)`` pairs where
        ``getattr(owner, attribute)`` is an ``nn.Module`` (the policy replaces its forward on
        the instance, parameters keep their names) or a plain callable such as an attention
        backend (the policy sets the attribute to a checkpointed stand-in with the same call).
        Every call of the part must depend only on its arguments and parameters (it runs again
        in the backward). An empty list: the model has no such parts (a policy that was asked
        for them refuses); an unknown kind raises ``ValueError``."""

    @abc.abstractmethod
    def moe_layers(self) -> list[tuple[str, nn.Module]]:
        """Every routed mixture-of-experts layer (:class:`gem_core.model.moe.MixtureOfExperts`)
        with its qualified name in ``named_modules()``, in forward order; empty without MoE.
        Expert-parallel strategies shard their ``experts``, set their ``dispatcher``, or
        replace a layer (by that name) with one that keeps its ``reports_moe_stats`` contract."""

    def output_heads(self) -> list[nn.Module]:
        """The modules that produce the logits (the task heads): precision recipes keep them,
        and every module inside them, in full precision (the loss and NE read their output).
        The default declares none: a model whose heads must stay in full precision under the
        FP8 recipes overrides it (the GEM model does)."""
        return []

    @abc.abstractmethod
    def stash_points(self) -> Mapping[str, list[nn.Module]]:
        """Modules whose tensors saved for backward the FP8 activation stash may quantize, by
        kind (every kind of :data:`STASH_KINDS` the model has, each with its modules, possibly
        none). The stash enters its hooks around each chosen module's forward."""


def require_strategy_model(model: nn.Module, user: str, method: str) -> StrategyModel:
    """``model`` as a :class:`StrategyModel`, or a ``GemConfigError`` naming the model class,
    the strategy ``user`` and the interface ``method`` it needed."""
    if isinstance(model, StrategyModel):
        return model
    raise GemConfigError(
        f"{user} needs {type(model).__name__}.{method}() of the model interface "
        f"{StrategyModel.__module__}.StrategyModel, which {type(model).__module__}."
        f"{type(model).__name__} does not implement (subclass StrategyModel and implement "
        "parallel_units, checkpoint_parts, moe_layers and stash_points)")


def check_checkpoint_kind(kind: str) -> None:
    """Raise ``ValueError`` for a kind outside :data:`CHECKPOINT_KINDS` (for implementations)."""
    if kind not in CHECKPOINT_KINDS:
        raise ValueError(f"checkpoint_parts: unknown kind {kind!r}; kinds: "
                         f"{', '.join(CHECKPOINT_KINDS)}")


def modules_of(model: nn.Module, kinds: Mapping[str, tuple[type, ...]]
               ) -> dict[str, list[nn.Module]]:
    """``{kind: every module of model that is an instance of the kind's classes}``: a helper for
    :meth:`StrategyModel.stash_points` implementations that classify by type."""
    return {kind: [m for m in model.modules() if isinstance(m, classes)]
            for kind, classes in kinds.items()}


ModelFactory = Callable[..., "nn.Module"]
"""What a ``model`` plugin's ``load()`` returns: ``factory(model_config, schema, *, attention,
embedding_backend, norm) -> nn.Module`` implementing :class:`RankingModel` and
:class:`StrategyModel`."""
