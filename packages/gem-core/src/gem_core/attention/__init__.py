"""One jagged attention API for the three shapes of the GEM model.

* self-attention over a history: ``q``/``k``/``v`` share offsets; causal, optional local window,
  contextual prefix tokens and target tokens at the tail (see :mod:`gem_core.attention.masks`);
* cross-attention, long query over a short K/V of the same sample;
* PMA, a few queries per sample over that sample's whole history.

Backends are registered through ``gem_register_attention_backends``; ``reference`` lives here.
"""

from gem_core.attention.api import (
    ATTENTION_CAPABILITIES,
    TORCH_COMPILE,
    TORCH_EXPORT,
    AttentionParams,
    validate_attention_inputs,
)
from gem_core.attention.reference import reference_attention
from gem_core.attention.relative_bias import RELATIVE_BIAS, RelativeBias
from gem_core.contracts import AttentionBackend

__all__ = [
    "ATTENTION_CAPABILITIES",
    "AttentionBackend",
    "AttentionParams",
    "RELATIVE_BIAS",
    "RelativeBias",
    "TORCH_COMPILE",
    "TORCH_EXPORT",
    "reference_attention",
    "validate_attention_inputs",
]
