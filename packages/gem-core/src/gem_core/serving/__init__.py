"""Serving: trained runs exported as ``torch.export`` programs with flat tensor inputs.

* :mod:`gem_core.serving.inputs`: the flat input dict of a program and the batch <-> dict maps;
* :mod:`gem_core.serving.programs`: the full model, the user tower and the ranker as modules;
* :mod:`gem_core.serving.export`: ``gem export-model`` (capture, AOTInductor, manifest, checks).

Nothing here is needed to *call* an exported program: that takes torch alone.
"""

from gem_core.serving.inputs import (
    CANDIDATES,
    CONTEXT,
    HISTORY,
    USER_EMBEDDING,
    InputSpec,
    batch_inputs,
    input_specs,
)

__all__ = ["CANDIDATES", "CONTEXT", "HISTORY", "USER_EMBEDDING", "InputSpec", "batch_inputs",
           "input_specs"]
