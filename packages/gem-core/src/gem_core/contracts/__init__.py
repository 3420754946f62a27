"""What each kind of plugin must provide, and what the trainer may rely on: one abstract base
class per kind.

An implementation subclasses its kind's contract: the abstract methods are the required part,
every other method has a default the trainer calls unconditionally (no optional attribute is
probed). The registry checks, when a run loads an implementation, that it is an instance of its
kind's contract (:func:`check_contract`), and names the plugin, its distribution, the kind and
the missing methods when it is not. Third-party plugins get the same contracts.

Function-like kinds are checked by what they are: a ``balancer`` is a callable ``(costs,
num_ranks) -> shares``, a ``data`` factory a callable ``(config, *, seed, options) ->
DataSource`` whose product is checked against :class:`DataSource` when the trainer builds it,
a ``cli`` command a ``click.Command``.

A model has two interfaces here: :class:`RankingModel` (what the training loop asks of it) and
:class:`StrategyModel` (what the strategies that transform it ask, with the kinds of parts it
answers for, :data:`CHECKPOINT_KINDS` and :data:`STASH_KINDS`).

The contracts are divided by meaning: :mod:`~gem_core.contracts.backends` (attention, norm,
embedding), :mod:`~gem_core.contracts.precision`, :mod:`~gem_core.contracts.strategies`
(embedding sharding, activation checkpointing, dense sharding),
:mod:`~gem_core.contracts.steps` (the step runner), :mod:`~gem_core.contracts.data` (data
source, training stream, time windows, balancer), :mod:`~gem_core.contracts.model`,
:mod:`~gem_core.contracts.sharded_modules` and :mod:`~gem_core.contracts.checking`. Import them
from here: ``from gem_core.contracts import DataSource``.
"""

from gem_core.contracts.backends import AttentionBackend, EmbeddingBackend, NormBackend
from gem_core.contracts.checking import check_contract, missing_methods
from gem_core.contracts.data import (
    Balancer,
    DataFactory,
    DataSource,
    DataWindow,
    TrainStream,
    WindowedSource,
)
from gem_core.contracts.model import (
    CHECKPOINT_KINDS,
    STASH_KINDS,
    ModelFactory,
    RankingModel,
    StrategyModel,
    check_checkpoint_kind,
    modules_of,
    require_strategy_model,
)
from gem_core.contracts.precision import PrecisionRecipe
from gem_core.contracts.sharded_modules import LearningRateFollower, ShardedModule
from gem_core.contracts.steps import PlainSteps, StepRunner
from gem_core.contracts.strategies import ActivationCheckpointing, DenseSharding, EmbeddingSharding

__all__ = [
    "CHECKPOINT_KINDS",
    "STASH_KINDS",
    "ActivationCheckpointing",
    "AttentionBackend",
    "Balancer",
    "DataFactory",
    "DataSource",
    "DataWindow",
    "DenseSharding",
    "EmbeddingBackend",
    "EmbeddingSharding",
    "LearningRateFollower",
    "ModelFactory",
    "NormBackend",
    "PlainSteps",
    "PrecisionRecipe",
    "RankingModel",
    "ShardedModule",
    "StepRunner",
    "StrategyModel",
    "TrainStream",
    "WindowedSource",
    "check_checkpoint_kind",
    "check_contract",
    "missing_methods",
    "modules_of",
    "require_strategy_model",
]

# A contract's one address is gem_core.contracts.<Name>: plugins import it from here, and the
# messages that name it (check_contract, require_strategy_model), docs/extending.md and pickles
# read its __module__. The submodules only divide the source, so that name does not show them.
for _exported in [globals()[name] for name in __all__]:
    if isinstance(_exported, type):
        _exported.__module__ = __name__
del _exported
