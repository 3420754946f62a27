"""The table of plugin kinds: for each kind, its hooks, its config key, its ``gem train`` flag and
its contract. Everything that lists the kinds derives from :data:`KIND_TABLE`: the registries
(:mod:`gem_core.registry`), the resolved backends of a run (:mod:`gem_core.train.backends`), the
backend options of ``gem train`` and ``gem plugins``; a test checks ``[backends]`` of the config
schema against it. Adding a kind is adding one row (and its hooks in :mod:`gem_core.hookspecs`).
"""

from __future__ import annotations

import operator
from typing import Any, Mapping

import attrs

from gem_core import contracts


@attrs.frozen(kw_only=True)
class Kind:
    """One kind of pluggable implementation."""

    name: str
    """The kind's name (``attention``), as in ``ImplementationSpec.kind`` and ``gem plugins``."""

    register_hook: str
    """The ``gem_register_*`` hook through which plugins register implementations of it."""

    default_hook: str | None
    """The ``gem_default_*`` hook that says what ``auto`` means; None: ``auto`` is not allowed."""

    config_key: str | None
    """Dotted key of the config naming the run's choice (``backends.attention``); None for kinds
    a run does not choose (``cli``)."""

    cli_flag: str | None
    """``gem train``'s shortcut for ``--set <config_key>=NAME`` (``--attention``); None: none."""

    cli_help: str = ""
    """The help of :attr:`cli_flag`."""

    contract: type | None
    """The abstract base class a loaded implementation must be an instance of; None for
    function-like kinds, whose ``load()`` must return a callable (see :attr:`returns`)."""

    returns: str
    """What ``load()`` returns, in words (for messages and ``docs/extending.md``)."""

    description: str
    """One line: what an implementation of this kind does."""

    options_key: str | None = None
    """Dotted key of the config table holding the options of the run's implementation
    (``parallel.dense``); each implementation declares their class (``ImplementationSpec.options``)
    and gets the table structured into it, keys under this path. None: the kind takes none."""

    @property
    def chosen_by_run(self) -> bool:
        """Whether every run resolves one implementation of this kind (it has a config key)."""
        return self.config_key is not None

    @property
    def cli_parameter(self) -> str | None:
        """The Python name click gives :attr:`cli_flag`'s value (``--embedding-sharding`` ->
        ``embedding_sharding``)."""
        return None if self.cli_flag is None else self.cli_flag.lstrip("-").replace("-", "_")

    def chosen_in(self, config: Any) -> str:
        """The name the config chooses for this kind (a registered name or ``auto``)."""
        if self.config_key is None:
            raise ValueError(f"a run does not choose a {self.name}: it has no config key")
        return operator.attrgetter(self.config_key)(config)

    def options_in(self, config: Any) -> Mapping[str, Any]:
        """The config's table of options for this kind's implementation (empty without
        :attr:`options_key`)."""
        return {} if self.options_key is None else operator.attrgetter(self.options_key)(config)


KIND_TABLE: tuple[Kind, ...] = (
    Kind(name="attention", register_hook="gem_register_attention_backends",
         default_hook="gem_default_attention", config_key="backends.attention",
         cli_flag="--attention", cli_help="Attention backend (gem plugins lists them).",
         contract=contracts.AttentionBackend, returns="an AttentionBackend instance",
         description="jagged attention of the sequence tower and the target attention"),
    Kind(name="norm", register_hook="gem_register_norm_backends",
         default_hook="gem_default_norm", config_key="backends.norm",
         cli_flag="--norm", cli_help="Gated-norm backend (model.attention_gate).",
         contract=contracts.NormBackend, returns="a NormBackend instance",
         description="gated LayerNorm/RMSNorm around attention (model.attention_gate)"),
    Kind(name="embedding", register_hook="gem_register_embedding_backends",
         default_hook="gem_default_embedding", config_key="backends.embedding",
         cli_flag="--embedding", cli_help="Embedding lookup backend.",
         contract=contracts.EmbeddingBackend, returns="an EmbeddingBackend instance",
         description="builds the embedding tables and their lookups"),
    Kind(name="model", register_hook="gem_register_models", default_hook=None,
         config_key="backends.model", cli_flag="--model",
         cli_help="Model (gem-core's: gem; gem plugins lists them).",
         contract=None,
         returns="a factory (model_config, schema, *, attention, embedding_backend, norm) -> "
                 "nn.Module implementing RankingModel and StrategyModel",
         description="the model trained, built from the run's attention, embedding and norm"),
    Kind(name="dense_sharding", register_hook="gem_register_dense_sharding",
         default_hook="gem_default_dense_sharding", config_key="backends.dense_sharding",
         cli_flag="--sharding", cli_help="Dense sharding strategy.",
         contract=contracts.DenseSharding, returns="a DenseSharding instance",
         description="wraps or shards the dense parameters; returns the Engine the trainer drives",
         options_key="parallel.dense"),
    Kind(name="embedding_sharding", register_hook="gem_register_embedding_sharding",
         default_hook="gem_default_embedding_sharding", config_key="backends.embedding_sharding",
         cli_flag="--embedding-sharding", cli_help="Embedding sharding strategy.",
         contract=contracts.EmbeddingSharding, returns="an EmbeddingSharding instance",
         description="places the embedding tables across the ranks",
         options_key="parallel.embedding"),
    Kind(name="precision", register_hook="gem_register_precision_recipes",
         default_hook="gem_default_precision", config_key="backends.precision",
         cli_flag="--precision", cli_help="Precision recipe.",
         contract=contracts.PrecisionRecipe, returns="a PrecisionRecipe instance",
         description="module conversion, autocast and parameter casting of a run",
         options_key="precision.options"),
    Kind(name="activation_checkpointing", register_hook="gem_register_activation_checkpointing",
         default_hook="gem_default_activation_checkpointing",
         config_key="backends.activation_checkpointing", cli_flag="--activation-checkpointing",
         cli_help="Activation-checkpointing policy.",
         contract=contracts.ActivationCheckpointing, returns="an ActivationCheckpointing instance",
         description="recomputes chosen activations in the backward",
         options_key="parallel.activation_checkpointing"),
    Kind(name="balancer", register_hook="gem_register_batch_balancers",
         default_hook="gem_default_balancer", config_key="backends.balancer",
         cli_flag="--balancer", cli_help="Batch balancer across ranks.",
         contract=None, returns="a function (costs, num_ranks) -> sample indices per rank",
         description="assigns the requests of a global batch to ranks"),
    Kind(name="data", register_hook="gem_register_data_sources", default_hook=None,
         config_key="data.source", cli_flag="--data", cli_help="Data source.",
         contract=None, returns="a factory (config: DataConfig, *, seed, options) -> DataSource",
         description="the feature schema, training stream and evaluation split",
         options_key="data.options"),
    Kind(name="cli", register_hook="gem_register_cli_commands", default_hook=None,
         config_key=None, cli_flag=None,
         contract=None, returns="a click.Command",
         description="a gem sub-command"),
)
"""Every kind, in the order ``gem plugins`` and ``gem train --help`` show them."""

KINDS_BY_NAME: dict[str, Kind] = {kind.name: kind for kind in KIND_TABLE}

RUN_KINDS: tuple[Kind, ...] = tuple(kind for kind in KIND_TABLE if kind.chosen_by_run)
"""The kinds every run resolves one implementation of (those with a config key)."""


def kind_named(name: str) -> Kind:
    """The row of ``name``; an unknown kind is an error naming the known ones."""
    from gem_core.errors import GemPluginError

    try:
        return KINDS_BY_NAME[name]
    except KeyError:
        raise GemPluginError(
            f"unknown kind {name!r}; kinds are {', '.join(KINDS_BY_NAME)}") from None
