"""Every hook of the GEM trainer, in one place. The docstring of each hook is its contract.

Plugins implement these with ``@gem_core.hookimpl`` in a module named by an entry point of the
``gem`` group (``[project.entry-points.gem]`` in the plugin's pyproject). gem-core's own reference
implementations are plugins too (``gem_core.builtin_plugin``).

Two families of hooks:

* ``gem_register_*(register)``: every plugin may contribute implementations of one kind by calling
  ``register(ImplementationSpec(...))`` once per implementation. Names are unique per kind across
  all plugins; a duplicate is an error at start-up that names both plugins. ``load`` must be lazy:
  registering must not import heavy libraries (triton, deepspeed, torchrec, torchao), because
  ``gem --help`` and ``gem plugins`` call every registration hook.
* ``gem_default_*(context)``: hooks that answer what ``auto`` means for one kind in a given
  :class:`~gem_core.registry.AutoContext`. Return the registered name of an implementation and a
  one-line reason, as ``(name, reason)``, or ``None`` to let the next plugin answer.

What ``load()`` returns must be an instance of its kind's abstract base class in
:mod:`gem_core.contracts` (function-like kinds: a callable); the registry checks it when a run
loads it, and ``resolve`` enforces the spec's declared ``devices``, ``dtypes`` and
``supports_backward`` against the run (:func:`gem_core.plugins.check_declared`). The table of
kinds (hooks, config keys, ``gem train`` flags, contracts) is :data:`gem_core.kinds.KIND_TABLE`.

**Order of ``auto`` answers.** The first non-None answer wins, asked in this explicit order (not
pluggy's registration order): implementations marked ``@hookimpl(tryfirst=True)`` first, then
unmarked ones by plugin (entry-point) name, alphabetically, then ``trylast=True`` ones. gem-core
answers ``trylast`` with its reference choice, so ``auto`` always resolves. A plugin that must
override another's answer marks its implementation ``tryfirst``;
:meth:`gem_core.plugins.GemPlugins.default_answerers` lists the order for a kind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import pluggy

if TYPE_CHECKING:
    from gem_core.registry import AutoContext, ImplementationSpec

PROJECT_NAME = "gem"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)

Register = Callable[["ImplementationSpec"], None]
DefaultChoice = tuple[str, str] | None


# ---------------------------------------------------------------------------------------------
# Registration hooks (all plugins answer).
# ---------------------------------------------------------------------------------------------


@hookspec
def gem_register_attention_backends(register: Register) -> None:
    """Register jagged attention backends (kind ``attention``).

    ``load()`` returns a :class:`gem_core.contracts.AttentionBackend`: a callable
    ``(q, k, v, q_offsets, kv_offsets, *, params, num_targets=None, max_q_len=None,
    max_kv_len=None, bias=None) -> Tensor`` that computes the same function as the reference
    backend (``gem_core.attention.reference``) for every mask, normalisation and shape it
    declares, with gradients for q, k and v when ``supports_backward`` is true. What it supports
    is declared as data in the spec's ``capabilities`` (the normalisations it computes and its
    optional features: :data:`gem_core.capabilities.ATTENTION_CAPABILITIES`), checked at
    start-up against the run; a backend called with what it does not declare raises an error
    naming it. It must pass :class:`gem_core.testing.AttentionConformance`.
    """


@hookspec
def gem_register_norm_backends(register: Register) -> None:
    """Register gated-norm backends (kind ``norm``).

    ``load()`` returns a :class:`gem_core.contracts.NormBackend`: ``gated_norm(x,
    gate, weight, bias=None, *, kind="layer"|"rms", eps=1e-5) -> Tensor`` computing ``(norm(x) *
    weight + bias) * gate`` over the last dimension, in ``x.dtype``, with gradients for x, gate,
    weight and bias, as :func:`gem_core.norm.gated_norm_reference` does. It must pass
    :class:`gem_core.testing.NormConformance`.
    """


@hookspec
def gem_register_embedding_backends(register: Register) -> None:
    """Register embedding backends (kind ``embedding``).

    ``load()`` returns a :class:`gem_core.contracts.EmbeddingBackend`, whose
    ``build(tables: Sequence[EmbeddingTableConfig]) -> nn.Module`` builds the tables. The
    module's ``forward(features: Mapping[str, Jagged]) -> dict[str, Tensor]`` looks up every
    table's feature: pooled tables give ``(batch, dim)``, unpooled tables give ``(total_ids, dim)``.
    Ids outside ``[0, num_embeddings)`` raise an error naming the table and the id.
    """


@hookspec
def gem_register_models(register: Register) -> None:
    """Register models (kind ``model``; the config's ``backends.model``, default ``gem``).

    ``load()`` returns a factory ``(model_config: ModelConfig, schema: FeatureSchema, *,
    attention, embedding_backend, norm) -> nn.Module``, called once per run (and by ``gem plan``
    on the ``meta`` device) with the run's ``[model]`` section, the data's feature schema and the
    run's resolved attention backend, embedding backend and gated-norm backend. The module:

    * has ``forward(batch: JaggedBatch) -> dict[str, Tensor]``: one ``(N,)`` logit per candidate
      for every task of ``schema.tasks``, as the GEM model does;
    * keeps its sparse tables in ``model.embeddings``, built by
      ``embedding_backend.build(tables)`` and read only through that attribute (embedding
      shardings replace it);
    * subclasses :class:`gem_core.contracts.RankingModel` (``flops`` and the optional losses and
      step statistics the training loop asks for) and
      :class:`gem_core.contracts.StrategyModel` (``parallel_units``,
      ``checkpoint_parts``, ``moe_layers``, ``stash_points``: what parallelism strategies and
      precision recipes use; they never walk its attributes).

    The trainer and ``load_run`` refuse a product that is not such a module, naming the plugin.
    gem-core registers ``gem`` (:func:`gem_core.model.build_model`).
    """


@hookspec
def gem_register_dense_sharding(register: Register) -> None:
    """Register dense-parameter parallelism strategies (kind ``dense_sharding``).

    ``load()`` returns a :class:`gem_core.contracts.DenseSharding`: ``apply(model, *,
    ctx: ParallelContext, make_optimizer, precision, options) -> Engine``. The strategy wraps or
    shards the model's dense parameters for the process group in ``ctx``, builds the optimizer
    with ``make_optimizer(module)`` (or owns the optimizer itself, as DeepSpeed does) and returns an
    :class:`gem_core.engine.Engine` whose ``backward``/``step``/``state_dict`` the trainer drives.
    Gradients must equal, within float tolerance, those of a single process on the union of the
    ranks' batches. ``precision`` is the run's recipe (its ``mixed_precision_policy()`` is for
    strategies that cast parameters); ``options`` is ``[parallel.dense]`` of the config as an
    instance of the spec's ``options`` class (None where it declares none), structured by gem-core.
    """


@hookspec
def gem_register_embedding_sharding(register: Register) -> None:
    """Register embedding-table sharding strategies (kind ``embedding_sharding``).

    ``load()`` returns a :class:`gem_core.contracts.EmbeddingSharding`: ``apply(model, *,
    ctx: ParallelContext, options) -> nn.Module`` (``options``: ``[parallel.embedding]``) that
    places the model's embedding tables (the module at ``model.embeddings``) across the process
    group, returning the model with the same forward semantics. It runs before dense sharding.
    ``summary() -> dict`` (default ``{}``; e.g. the plan per table), written to ``summary.json``
    under ``embedding_sharding``.
    """


@hookspec
def gem_register_precision_recipes(register: Register) -> None:
    """Register precision recipes (kind ``precision``).

    ``load()`` returns a :class:`gem_core.contracts.PrecisionRecipe`:
    ``convert(model, ctx, options) -> model`` (module swaps such as FP8 linears; runs first in
    ``parallelize()``), ``autocast(device) -> context manager`` around forward and loss, and
    ``mixed_precision_policy()`` for sharding strategies that cast parameters themselves. Master
    weights, loss and metrics stay in float32. Parts with defaults in the contract:
    ``calibration_batches_for(options) -> int`` (0) with ``calibrate(model, batches, loss_fn,
    options)``, called once before ``convert`` with that many training batches from a separate
    stream (the training stream itself is not advanced), for recipes that choose by measuring;
    ``after_optimizer_step(model)`` after every step taken; ``summary() -> dict``, written to
    ``summary.json`` under ``precision``. The spec declares ``activation_dtype``: the dtype the
    rest of the model computes in under the recipe, which every other choice of the run must
    list in its ``dtypes``. ``options`` is ``[precision.options]`` as an instance of the spec's
    ``options`` class (None where it declares none), structured by gem-core.
    """


@hookspec
def gem_register_activation_checkpointing(register: Register) -> None:
    """Register activation-checkpointing policies (kind ``activation_checkpointing``).

    ``load()`` returns a :class:`gem_core.contracts.ActivationCheckpointing`: ``apply(model, *,
    ctx: ParallelContext, options) -> nn.Module`` (``options``:
    ``[parallel.activation_checkpointing]``) that wraps chosen submodules so their activations
    are recomputed in the backward instead of stored. It runs in ``parallelize()`` after
    embedding sharding and before dense sharding, and must leave the model's outputs and gradients
    unchanged (only memory and time change).
    """


@hookspec
def gem_register_data_sources(register: Register) -> None:
    """Register data sources (kind ``data``).

    ``load()`` returns a factory ``(config: DataConfig, *, seed: int, options) -> DataSource``
    (``options``: ``[data.options]`` as an instance of the spec's ``options`` class; see
    :class:`gem_core.contracts.DataSource`; the trainer refuses a product that is not one): a
    feature schema, a deterministic stream of global training batches with a resumable
    position, and a fixed held-out evaluation split.
    """


@hookspec
def gem_register_batch_balancers(register: Register) -> None:
    """Register batch balancers (kind ``balancer``).

    ``load()`` returns a callable ``(costs: Sequence[float], num_ranks: int) -> list[list[int]]``
    that assigns every sample index of a global batch to exactly one rank (each index once, none
    lost), deterministically for the same input. The goal is to even out the per-rank cost.
    """


@hookspec
def gem_register_cli_commands(register: Register) -> None:
    """Register ``gem`` sub-commands (kind ``cli``).

    ``load()`` returns a ``click.Command`` (or ``click.Group``); ``name`` is the word after ``gem``
    and ``description`` its one-line help. The command is imported only when it is invoked.
    """


# ---------------------------------------------------------------------------------------------
# `auto` resolution hooks (first non-None answer in the order above wins; gem-core answers last).
# ---------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def gem_default_attention(context: AutoContext) -> DefaultChoice:
    """Name the attention backend ``auto`` means in ``context``, with a reason, or None."""


@hookspec(firstresult=True)
def gem_default_norm(context: AutoContext) -> DefaultChoice:
    """Name the gated-norm backend ``auto`` means in ``context``, with a reason, or None."""


@hookspec(firstresult=True)
def gem_default_embedding(context: AutoContext) -> DefaultChoice:
    """Name the embedding backend ``auto`` means in ``context``, with a reason, or None."""


@hookspec(firstresult=True)
def gem_default_dense_sharding(context: AutoContext) -> DefaultChoice:
    """Name the dense sharding strategy ``auto`` means in ``context``, with a reason, or None."""


@hookspec(firstresult=True)
def gem_default_embedding_sharding(context: AutoContext) -> DefaultChoice:
    """Name the embedding sharding strategy ``auto`` means in ``context``, with a reason, or
    None."""


@hookspec(firstresult=True)
def gem_default_precision(context: AutoContext) -> DefaultChoice:
    """Name the precision recipe ``auto`` means in ``context``, with a reason, or None."""


@hookspec(firstresult=True)
def gem_default_activation_checkpointing(context: AutoContext) -> DefaultChoice:
    """Name the activation-checkpointing policy ``auto`` means in ``context``, with a reason, or
    None."""


@hookspec(firstresult=True)
def gem_default_balancer(context: AutoContext) -> DefaultChoice:
    """Name the batch balancer ``auto`` means in ``context``, with a reason, or None."""
