"""One jagged attention API for the three shapes of the GEM model.

* self-attention over a history: ``q``/``k``/``v`` share offsets; causal, optional local window,
  contextual prefix tokens and target tokens at the tail (see :mod:`gem_core.attention.masks`);
* cross-attention, long query over a short K/V of the same sample;
* PMA, a few queries per sample over that sample's whole history.

This package module exports the types of the call (its parameters, the relative bias and the
input checks); the contract a backend implements is :class:`gem_core.contracts.AttentionBackend`,
the capability names it declares are in :mod:`gem_core.capabilities`. Backends are registered
through ``gem_register_attention_backends``; gem-core's live in
:mod:`gem_core.attention.reference`, :mod:`~gem_core.attention.bucketed` and
:mod:`~gem_core.attention.padded`.
"""

from gem_core.attention.api import AttentionParams, validate_attention_inputs
from gem_core.attention.relative_bias import RelativeBias

__all__ = ["AttentionParams", "RelativeBias", "validate_attention_inputs"]
