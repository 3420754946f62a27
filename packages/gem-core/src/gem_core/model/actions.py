"""Which event feature holds the actions: the model's own option, or the data's declaration.

``model.action_feature`` names the event feature whose ids say what kind of event each history
event was (a page view, a click, a purchase); the options that tell engaged events from views
read it. A preset cannot name it, since each data set calls it something else (``action``,
``btag``) and some have none (ratings): ``model.action_feature = "schema"`` reads what the data
set declares in its schema (``FeatureSchema.action_feature`` and ``view_action``). This module
is the one place that turns that into a feature name and a view id; the trainer records the
result (:func:`gem_core.train.applied.config_as_source_applies`) and a model built straight
from a configuration resolves it the same way.
"""

from __future__ import annotations

import attrs

from gem_core.config import ModelConfig
from gem_core.errors import GemConfigError
from gem_core.schema import FeatureSchema

#: The value of ``model.action_feature`` that reads the schema's declaration.
FROM_SCHEMA = "schema"


def declared_actions(config: ModelConfig, schema: FeatureSchema) -> ModelConfig:
    """``config`` with ``action_feature = "schema"`` replaced by what ``schema`` declares: its
    ``action_feature`` and ``view_action``, or no action feature (and view id 0) where it
    declares none. ``config`` as it is for any other value. Raises ValueError where an option
    needs an action feature and the schema declares none."""
    if config.action_feature != FROM_SCHEMA:
        return config
    view = schema.view_action if schema.action_feature else 0
    try:
        return attrs.evolve(config, action_feature=schema.action_feature, view_action=view)
    except ValueError as error:
        raise GemConfigError(f"model.action_feature = {FROM_SCHEMA!r} reads the data's declared "
                             f"action feature, and this data declares none: {error}") from None


def latest_by_action(config: ModelConfig) -> bool:
    """Whether target match's latest-match token is on for ``config`` (already resolved by
    :func:`declared_actions`): ``target_match_latest`` true, or ``"with_actions"`` where there
    is an action feature."""
    if config.target_match_latest == "with_actions":
        return bool(config.action_feature)
    return bool(config.target_match_latest)
