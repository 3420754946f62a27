"""A configuration as its data source applies it: the one place that says what a model built
from a configuration and a data source is built from. The trainer, ``gem config show``, an
opened trained run, the benches and ``gem plan`` all go through
:func:`config_as_source_applies`, so a setting the source decides (a data set's own
``max_seq_len``, an action given by its text) means the same in each of them."""

from __future__ import annotations

import logging

import attrs

from gem_core.config import GemConfig
from gem_core.contracts import DataSource
from gem_core.errors import GemConfigError
from gem_core.model.actions import declared_actions

log = logging.getLogger(__name__)


def config_as_source_applies(config: GemConfig, source: DataSource) -> GemConfig:
    """``config`` as ``source`` applies it, where ``source`` was built from ``config.data``:
    ``data`` replaced by :meth:`DataSource.applied_config` (e.g. a data set's own
    ``max_seq_len`` in place of a preset's), ``model.action_feature = "schema"`` replaced by the
    source's declared actions (:func:`~gem_core.model.actions.declared_actions`) and
    ``model.view_action`` given as text resolved to the source's raw id
    (:func:`resolve_view_action`). This is what a run records and builds
    its model from; raises :class:`~gem_core.errors.GemConfigError` where the source cannot
    look the view action up."""
    try:
        model = declared_actions(config.model, source.schema)
    except ValueError as error:
        raise GemConfigError(str(error)) from None
    if model is not config.model:
        log.info("model.action_feature = 'schema': the data declares %s", (
            f"event feature {model.action_feature!r} (view action {model.view_action!r})"
            if model.action_feature else "no action feature"))
    return resolve_view_action(attrs.evolve(config, data=source.applied_config(config.data),
                                            model=model), source)


def resolve_view_action(config: GemConfig, source: DataSource) -> GemConfig:
    """``config`` with ``model.view_action`` given as the action's text (``"pv"``) replaced by
    the raw id ``source`` uses for it in ``model.action_feature`` (:meth:`DataSource.raw_id`),
    so the run records, and the model compares the event ids with, an integer; ``config`` as
    it is where ``view_action`` is already an id."""
    text, feature = config.model.view_action, config.model.action_feature
    if not isinstance(text, str):
        return config
    try:
        raw = source.raw_id(feature, text)
    except GemConfigError as error:
        raise GemConfigError(f"model.view_action = {text!r}: {error}") from None
    log.info("model.view_action %r is id %d of event feature %s (the vocabulary of data "
             "source %r)", text, raw, feature, config.data.source)
    return attrs.evolve(config, model=attrs.evolve(config.model, view_action=raw))
