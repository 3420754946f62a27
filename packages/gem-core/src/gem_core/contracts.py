"""What each kind of plugin must provide, and what the trainer may rely on: one abstract base
class per kind.

An implementation subclasses its kind's contract: the abstract methods are the required part,
every other method has a default the trainer calls unconditionally (no optional attribute is
probed). The registry checks, when a run loads an implementation, that it is an instance of its
kind's contract (:func:`check_contract`), and names the plugin, its distribution, the kind and
the missing methods when it is not. Third-party plugins get the same contracts.

Function-like kinds are checked by what they are: a ``balancer`` is a callable ``(costs,
num_ranks) -> shares``, a ``data`` factory a callable ``(config, *, seed) -> DataSource`` whose
product is checked against :class:`DataSource` when the trainer builds it, a ``cli`` command a
``click.Command``.

A model has two interfaces here: :class:`RankingModel` (what the training loop asks of it) and
:class:`StrategyModel` (what the strategies that transform it ask, with the kinds of parts it
answers for, :data:`CHECKPOINT_KINDS` and :data:`STASH_KINDS`).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Mapping, Sequence

from gem_core.errors import GemConfigError, GemPluginError

if TYPE_CHECKING:
    from torch import Tensor, nn

    from gem_core.attention.api import AttentionParams
    from gem_core.attention.relative_bias import RelativeBias
    from gem_core.batch import JaggedBatch
    from gem_core.distributed import ParallelContext
    from gem_core.embedding_tables import EmbeddingTableConfig
    from gem_core.engine import Engine
    from gem_core.plan_estimate import Estimate, PlanFacts
    from gem_core.schema import FeatureSchema


# ---------------------------------------------------------------------------------------------
# Backends the model calls: attention, gated norm, embedding tables.
# ---------------------------------------------------------------------------------------------


class AttentionBackend(abc.ABC):
    """A jagged attention implementation (kind ``attention``).

    ``q``: ``(total_q, heads, head_dim)`` with ``q_offsets`` ``(batch + 1,)``; ``k``, ``v``:
    ``(total_kv, heads, head_dim)`` with ``kv_offsets``. Returns ``(total_q, heads, head_dim)`` in
    ``q.dtype``. ``num_targets`` ``(batch,)`` counts target tokens at the tail of each sequence
    (self-attention only). ``max_q_len``/``max_kv_len`` are upper bounds a kernel may use to size
    its grid without a device sync. A sample with no keys outputs zeros. It computes the same
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


# ---------------------------------------------------------------------------------------------
# Strategies parallelize() applies, in this order: precision, embedding sharding, activation
# checkpointing, dense sharding.
# ---------------------------------------------------------------------------------------------


class PrecisionRecipe(abc.ABC):
    """How a run computes (kind ``precision``). Master weights, loss and metrics stay in float32.

    The required part is ``convert``, ``autocast`` and ``mixed_precision_policy``. A recipe that
    chooses by measuring (automatic FP8 selection) asks for calibration batches
    (:meth:`calibration_batches_for`) and overrides :meth:`calibrate`.
    """

    name: str = ""
    """The registered name, for messages."""

    compute_dtype: str = "float32"
    """The dtype its matmuls run in (``float32``, ``bfloat16``, ``float8``...), for reports."""

    calibration_batches: int = 0
    """Training batches :meth:`calibrate` needs (the default of :meth:`calibration_batches_for`)."""

    @abc.abstractmethod
    def convert(self, model: nn.Module, ctx: Any, options: Mapping[str, Any]) -> nn.Module:
        """Swap modules (e.g. FP8 linears); runs first in ``parallelize()``. ``options`` is
        ``[precision.options]`` of the config; the recipe validates it (unknown keys are an
        error)."""

    @abc.abstractmethod
    def autocast(self, device_type: str) -> ContextManager[None]:
        """Context around forward and loss."""

    @abc.abstractmethod
    def mixed_precision_policy(self) -> Any:
        """For sharding strategies that cast parameters themselves (FSDP2); None for none."""

    def calibration_batches_for(self, options: Mapping[str, Any]) -> int:
        """How many training batches :meth:`calibrate` gets with these options (0: none, and
        no calibration)."""
        return self.calibration_batches

    def calibrate(self, model: nn.Module, batches: Sequence[Any],
                  loss_fn: Callable[[Any, Any], Tensor], options: Mapping[str, Any]) -> Any:
        """Called once before ``convert`` with :meth:`calibration_batches_for` training batches
        from a separate stream (the training stream itself is not advanced). The default
        accepts only no batches: a recipe that asks for batches must say what it does with
        them."""
        if batches:
            raise NotImplementedError(
                f"precision recipe {self.name or type(self).__name__!r} asks for "
                f"{len(batches)} calibration batches but does not override calibrate()")
        return None

    def after_optimizer_step(self, model: nn.Module) -> None:
        """After every optimizer step taken (e.g. FP8 scales for FSDP2's FP8 all-gather)."""
        return None  # default: a recipe without per-step work does nothing

    def summary(self) -> dict[str, Any]:
        """Written to ``summary.json`` under ``precision`` (e.g. the layers converted)."""
        return {}


class EmbeddingSharding(abc.ABC):
    """Places the model's embedding tables across the process group (kind
    ``embedding_sharding``). It runs before activation checkpointing and dense sharding."""

    @abc.abstractmethod
    def apply(self, model: nn.Module, *, ctx: ParallelContext,
              options: Mapping[str, Any]) -> nn.Module:
        """Shard the module at ``model.embeddings``; return the model with the same forward
        semantics. ``options``: ``[parallel.embedding]``, validated here."""

    def plan_estimate(self, facts: PlanFacts, options: Mapping[str, Any]) -> Estimate | None:
        """Memory per rank and bytes sent per step under this strategy, for ``gem plan``, from
        the facts it measured (:mod:`gem_core.plan_estimate`); ``options`` are this kind's
        ``[parallel.*]`` options, validated here. None (this default): it gives no estimate,
        and the plan says so, naming it, instead of guessing."""
        return None

    def summary(self) -> dict[str, Any]:
        """Written to ``summary.json`` under ``embedding_sharding`` (e.g. the plan per table)."""
        return {}

    def step_runner(self, stream: TrainStream, *, model: nn.Module, schema: FeatureSchema,
                    ctx: ParallelContext, options: Mapping[str, Any]) -> StepRunner:
        """How the trainer's steps get their batches from ``stream`` once ``model`` (unwrapped,
        after :meth:`apply`) is built: e.g. a pipeline that distributes the sparse inputs of the
        next batch while this one computes. ``options``: ``[parallel.embedding]``. The default
        runs each step on the stream's next batch, nothing ahead (:class:`PlainSteps`)."""
        return PlainSteps(stream)


class StepRunner(abc.ABC):
    """Runs the trainer's steps over the training stream (what
    :meth:`EmbeddingSharding.step_runner` returns). A runner may fetch batches ahead of the one
    it trains (a pipeline); :meth:`data_position` is then still the stream's position right
    after the last batch *trained*, so a checkpoint resumes with the exact next batch
    (:class:`gem_core.train.step_pipeline.PositionedBatches` records it)."""

    @abc.abstractmethod
    def run_step(self, step: Callable[[JaggedBatch], dict[str, Any]]) -> dict[str, Any]:
        """Run ``step`` (forward, loss, backward and optimizer step of one batch, returning its
        metrics record) on the next batch and return its record. Every rank calls it together."""

    @abc.abstractmethod
    def data_position(self) -> dict[str, Any]:
        """The stream's ``state_dict()`` as it was right after the last batch trained (before
        any step: the stream's own)."""


class ActivationCheckpointing(abc.ABC):
    """Recomputes chosen activations in the backward instead of storing them (kind
    ``activation_checkpointing``). Outputs and gradients stay the same; memory and time change."""

    @abc.abstractmethod
    def apply(self, model: nn.Module, *, ctx: ParallelContext,
              options: Mapping[str, Any]) -> nn.Module:
        """Wrap the chosen submodules; ``options``: ``[parallel.activation_checkpointing]``."""

    def compiler_settings(self, options: Mapping[str, Any]) -> Mapping[str, Any]:
        """``torch._functorch.config`` settings under which the compiled step (``train.compile``)
        compiles, e.g. ``{"activation_memory_budget": 0.5}`` (the compiler then chooses what to
        recompute). Non-empty means the policy works only through the compiler: a run without
        ``train.compile`` refuses it. Empty (this default): none."""
        return {}

    def plan_estimate(self, facts: PlanFacts, options: Mapping[str, Any]) -> Estimate | None:
        """Memory per rank and bytes sent per step under this strategy, for ``gem plan``, from
        the facts it measured (:mod:`gem_core.plan_estimate`); ``options`` are this kind's
        ``[parallel.*]`` options, validated here. None (this default): it gives no estimate,
        and the plan says so, naming it, instead of guessing."""
        return None


class DenseSharding(abc.ABC):
    """Wraps or shards the model's dense parameters and returns the Engine the trainer drives
    (kind ``dense_sharding``). Gradients equal, within float tolerance, those of one process on
    the union of the ranks' batches."""

    @abc.abstractmethod
    def apply(self, model: nn.Module, *, ctx: ParallelContext,
              make_optimizer: Callable[[nn.Module], Any], precision: PrecisionRecipe,
              options: Mapping[str, Any]) -> Engine:
        """Wrap ``model`` for ``ctx``'s process group, build the optimizer with
        ``make_optimizer(module)`` (or own it, as DeepSpeed does) and return an
        :class:`gem_core.engine.Engine` (whose ``summary()`` goes to ``summary.json`` under
        ``dense_sharding``). ``precision``'s ``mixed_precision_policy()`` is for strategies that
        cast parameters; ``options`` is ``[parallel.dense]``, validated here."""

    def plan_estimate(self, facts: PlanFacts, options: Mapping[str, Any]) -> Estimate | None:
        """Memory per rank and bytes sent per step under this strategy, for ``gem plan``, from
        the facts it measured (:mod:`gem_core.plan_estimate`); ``options`` are this kind's
        ``[parallel.*]`` options, validated here. None (this default): it gives no estimate,
        and the plan says so, naming it, instead of guessing."""
        return None


# ---------------------------------------------------------------------------------------------
# Data.
# ---------------------------------------------------------------------------------------------


class TrainStream(abc.ABC):
    """This rank's share of each global training batch, in a deterministic order.

    ``state_dict()`` is the position after the last batch returned; loading it into a stream
    built with the same arguments continues with the exact next batch (resume).

    Resuming with another number of ranks: a position that is the same on every rank is taken to
    be global (e.g. the index of the next global batch) and is loaded on every new rank, so the
    run continues at the same global batch; a stream whose position is per rank must save
    something that differs between ranks (e.g. its rank) or refuse in ``load_state_dict`` with
    a ``GemDataError``, and the trainer then stops with an error naming the source.
    """

    def __iter__(self) -> Iterator[JaggedBatch]:
        return self

    @abc.abstractmethod
    def __next__(self) -> JaggedBatch: ...

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None:
        """Stop and join any background work (e.g. threads reading ahead) and release files.
        The trainer calls it when the run ends, successfully or not, before the process group
        is destroyed; a stream without background work does nothing (this default)."""
        return None


class PlainSteps(StepRunner):
    """The default :class:`StepRunner`: each step on the stream's next batch; nothing is fetched
    ahead, so the data position is the stream's own."""

    def __init__(self, stream: TrainStream) -> None:
        self.stream = stream

    def run_step(self, step: Callable[[JaggedBatch], dict[str, Any]]) -> dict[str, Any]:
        return step(next(self.stream))

    def data_position(self) -> dict[str, Any]:
        return self.stream.state_dict()


class DataSource(abc.ABC):
    """What a registered ``data`` factory ``(config: DataConfig, *, seed: int) -> DataSource``
    builds: a feature schema, a deterministic stream of global training batches with a
    resumable position, and a fixed held-out evaluation split.

    ``schema`` declares the data's tables, event, candidate and context features and tasks
    (:class:`~gem_core.schema.FeatureSchema`); every batch it yields is a request-level
    :class:`~gem_core.batch.JaggedBatch` that passes ``batch.validate(schema)``."""

    schema: FeatureSchema

    @abc.abstractmethod
    def train_stream(self, *, batch_size: int, rank: int, world_size: int,
                     balancer: Callable[[Sequence[float], int], list[list[int]]],
                     cost_fn: Callable[[JaggedBatch], Sequence[float]]) -> TrainStream:
        """Global batches of ``batch_size`` requests (each with its ``K >= 1`` candidates),
        split across ranks by ``balancer`` applied to ``cost_fn(global_batch)`` (one cost per
        request); yields this rank's share."""

    @abc.abstractmethod
    def eval_batches(self, *, batch_size: int) -> Iterator[JaggedBatch]:
        """The whole held-out split, the same on every rank, in a fixed order."""

    @abc.abstractmethod
    def fingerprint(self) -> dict[str, Any]:
        """What identifies the data beyond ``[data]`` and the seed (e.g. a digest of a data
        set's manifest, which changes when the data set is regenerated in place). Every
        checkpoint stores it and a resume on data with another fingerprint is refused. Data
        that is a pure function of the config and the seed (generated data) returns ``{}``."""

    def report(self) -> dict[str, Any]:
        """Counts for ``summary.json`` under ``data`` and the log (``rows_checked``,
        ``rows_dropped``, ``rows_repaired`` per check, ``histories_truncated``: see
        :mod:`gem_core.train.data_log`); a source that checks nothing reports ``{}``."""
        return {}


class WindowedSource(DataSource):
    """A data source whose training data is divided into time windows, oldest first, and that
    can stream them in time order (capability ``time_windows``; ``data.order = "time"``).

    With ``data.order = "time"``, ``train_stream`` reads the windows once, in order, ending
    every window with a batch of its own (a window's last batch may be short), so no batch mixes
    two windows; it raises ``StopIteration`` after the last window. Its position (the
    ``state_dict()``) stays valid when the data set gains windows after the last one read: a
    run stopped at the end of the data continues with the new windows. ``fingerprint()`` then
    holds ``windows``: ``"name=digest;name=digest..."`` of the windows in order, which a
    checkpoint's must be the start of (a data set that gained windows is the same data,
    continued)."""

    @abc.abstractmethod
    def windows(self) -> Sequence[DataWindow]:
        """The time windows, oldest first; empty when the data is not divided into windows."""

    @abc.abstractmethod
    def window_at(self, position: Mapping[str, Any]) -> tuple[int, bool]:
        """For a time-order training stream's ``position`` (its ``state_dict()``): the index
        of the window its next batch comes from (``len(windows())`` once every window has been
        read) and whether that window has been begun (some of its requests already read)."""

    @abc.abstractmethod
    def window_eval_batches(self, index: int, *, batch_size: int) -> Iterator[JaggedBatch]:
        """Window ``index``'s requests (at most ``data.eval_rows``), in file order, the same on
        every rank: what progressive evaluation scores before training on the window."""


class DataWindow:
    """One time window of a :class:`WindowedSource`: its name, requests and time range
    (``request_timestamp`` seconds)."""

    __slots__ = ("name", "rows", "first_time", "last_time")

    def __init__(self, *, name: str, rows: int, first_time: int, last_time: int) -> None:
        self.name, self.rows = name, rows
        self.first_time, self.last_time = first_time, last_time

    def __repr__(self) -> str:
        return (f"DataWindow(name={self.name!r}, rows={self.rows}, first_time={self.first_time}, "
                f"last_time={self.last_time})")


DataFactory = Callable[..., DataSource]
"""``(config: DataConfig, *, seed: int) -> DataSource``: what a ``data`` spec's ``load()``
returns."""

Balancer = Callable[[Sequence[float], int], list[list[int]]]
"""``(per-sample costs, number of ranks) -> sample indices per rank`` (kind ``balancer``): every
index exactly once, deterministic for the same input."""


# ---------------------------------------------------------------------------------------------
# What the trainer relies on in the model and in the modules strategies put into it.
# ---------------------------------------------------------------------------------------------


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


class LearningRateFollower(abc.ABC):
    """A module with an optimizer of its own (TorchRec's fused sparse one) that follows the
    run's learning-rate schedule: the trainer calls :meth:`follow_learning_rate` every step on
    every such module of the model."""

    @abc.abstractmethod
    def follow_learning_rate(self, factor: float) -> float | None:
        """Set its learning rate to its base rate times ``factor`` (the schedule's current
        multiplier); return the rate set, or None when it has none to report."""


class ShardedModule(abc.ABC):
    """A module of the model whose state the dense engine's state dict does not hold
    (TorchRec-sharded tables and their fused optimizer); see
    :mod:`gem_core.train.sharded_modules` for how the checkpointer stores it. Every rank calls
    these methods together."""

    @abc.abstractmethod
    def sharded_checkpoint_state(self) -> dict[str, dict[str, Any]]:
        """``{"model": {name: tensor}, "optimizer": {name: {state: tensor}}}``: live
        ``ShardedTensor``s that DCP writes shard by shard and loads into in place, resharding by
        offsets."""

    @abc.abstractmethod
    def checkpoint_layout(self) -> dict[str, Any]:
        """Plain data recorded in ``trainer.json`` (``sharded_modules``)."""

    @abc.abstractmethod
    def check_checkpoint_layout(self, saved: dict[str, Any]) -> None:
        """Raise ``GemConfigError`` when the saved layout's state cannot continue in this one
        (checked before anything loads)."""

    @abc.abstractmethod
    def checkpoint_loaded(self) -> None:
        """Called after loading."""


# ---------------------------------------------------------------------------------------------
# Checking an implementation against its contract.
# ---------------------------------------------------------------------------------------------


def missing_methods(obj: Any, contract: type) -> list[str]:
    """The abstract methods of ``contract`` that ``obj`` (or its class) does not define: what to
    name when ``obj`` does not subclass ``contract``."""
    owner = obj if isinstance(obj, type) else type(obj)
    defined = {name for klass in owner.__mro__ for name, value in vars(klass).items()
               if callable(value)}
    return sorted(set(contract.__abstractmethods__) - defined)


def check_contract(obj: Any, contract: type | None, *, kind: str, name: str, plugin: str = "",
                   distribution: str = "") -> None:
    """Raise ``GemPluginError`` unless ``obj`` satisfies ``contract``: an instance of it (a
    class), or a callable (``None``: function-like kinds). The message names the
    implementation, its plugin and distribution, the kind and what is missing."""
    where = f"{kind} {name!r} (plugin {plugin or '?'}, distribution {distribution or '?'})"
    if contract is None:
        if not callable(obj):
            raise GemPluginError(f"{where} loaded a {type(obj).__name__}, which is not callable; "
                                 f"a {kind} is a function (see the hook's docstring)")
        return
    if isinstance(obj, contract):
        return
    missing = missing_methods(obj, contract)
    detail = (f"it lacks {', '.join(missing)}" if missing else
              "it has the methods but does not declare the contract")
    raise GemPluginError(
        f"{where} loaded a {type(obj).__name__}, which does not implement "
        f"{contract.__module__}.{contract.__qualname__}: {detail}; subclass "
        f"{contract.__qualname__} and implement its abstract methods")

