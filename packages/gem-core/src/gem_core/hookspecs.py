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

    ``load()`` returns a :class:`gem_core.contracts.AttentionBackend`, whose docstring is the
    contract. What a backend supports is declared as data in the spec's ``capabilities``
    (:mod:`gem_core.capabilities`) and checked at start-up against the run. It must pass
    :class:`gem_core.testing.AttentionConformance`.
    """


@hookspec
def gem_register_norm_backends(register: Register) -> None:
    """Register gated-norm backends (kind ``norm``).

    ``load()`` returns a :class:`gem_core.contracts.NormBackend` (the contract), computing what
    :func:`gem_core.norm.gated_norm_reference` computes. It must pass
    :class:`gem_core.testing.NormConformance`.
    """


@hookspec
def gem_register_embedding_backends(register: Register) -> None:
    """Register embedding backends (kind ``embedding``).

    ``load()`` returns a :class:`gem_core.contracts.EmbeddingBackend` (the contract).
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

    ``load()`` returns a :class:`gem_core.contracts.DenseSharding` (the contract: ``apply``
    returns the :class:`gem_core.engine.Engine` the trainer drives). The spec's ``options``
    class types ``[parallel.dense]`` (:mod:`gem_core.contracts.strategies`).
    """


@hookspec
def gem_register_embedding_sharding(register: Register) -> None:
    """Register embedding-table sharding strategies (kind ``embedding_sharding``).

    ``load()`` returns a :class:`gem_core.contracts.EmbeddingSharding` (the contract). The
    spec's ``options`` class types ``[parallel.embedding]``.
    """


@hookspec
def gem_register_precision_recipes(register: Register) -> None:
    """Register precision recipes (kind ``precision``).

    ``load()`` returns a :class:`gem_core.contracts.PrecisionRecipe` (the contract). The spec
    declares ``activation_dtype``, the dtype the rest of the model computes in under the recipe,
    which every other choice of the run must list in its ``dtypes``; its ``options`` class
    types ``[precision.options]``.
    """


@hookspec
def gem_register_activation_checkpointing(register: Register) -> None:
    """Register activation-checkpointing policies (kind ``activation_checkpointing``).

    ``load()`` returns a :class:`gem_core.contracts.ActivationCheckpointing` (the contract). The
    spec's ``options`` class types ``[parallel.activation_checkpointing]``.
    """


@hookspec
def gem_register_data_sources(register: Register) -> None:
    """Register data sources (kind ``data``).

    ``load()`` returns a factory ``(config: DataConfig, *, seed: int, options) -> DataSource``
    (:data:`gem_core.contracts.DataFactory`; the product is a
    :class:`gem_core.contracts.DataSource`, the contract, and the trainer refuses one that is
    not). The spec's ``options`` class types ``[data.options]``.
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
