"""Serving: trained runs exported as ``torch.export`` programs with flat tensor inputs.

* :mod:`gem_core.serving.inputs`: the flat input dict of a program and the batch <-> dict maps;
* :mod:`gem_core.serving.programs`: the full model, the user tower and the ranker as modules;
* :mod:`gem_core.serving.export`: ``gem export-model`` (capture, AOTInductor, manifest, checks);
* :mod:`gem_core.serving.integrity`: the manifest's record of every file, and its checks;
* :mod:`gem_core.serving.publish`: an export directory written whole or not at all;
* :mod:`gem_core.serving.archive`: what a ``.pt2`` may hold before torch loads it (no code);
* :mod:`gem_core.serving.loading`: the one way this repository loads an exported program.

Nothing here is needed to *call* an exported program: that takes torch alone. An export is
untrusted input to this repository's readers (``gem score``): they load it only through
:func:`gem_core.serving.loading.load_program`.
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
