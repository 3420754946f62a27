"""What a run asks of its attention backend, checked at start-up against what the backend's
registration declares (``ImplementationSpec.capabilities``), so a run that cannot work stops
before anything is built, with one line naming the backend, what it lacks, the setting that needs
it and the installed backends that have everything the run needs (read from the registry).

This is the one check of every attention capability: the normalisations and the relative bias the
model asks for, ``torch_compile`` for ``train.compile``, ``torch_export`` for ``gem
export-model`` (and what a compiled model cannot do yet)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from gem_core.capabilities import (
    NORMALIZATIONS,
    RELATIVE_BIAS,
    SOFTMAX,
    TORCH_COMPILE,
    TORCH_EXPORT,
    declared_by,
)
from gem_core.errors import GemConfigError

if TYPE_CHECKING:
    from gem_core.config import ModelConfig
    from gem_core.registry import ImplementationSpec


def attention_needs(model: ModelConfig, *, compile: bool = False, export: bool = False
                    ) -> dict[str, str]:
    """Each capability the run's attention calls need, with the setting that needs it:
    ``compile`` for a compiled run (``train.compile``), ``export`` for ``gem export-model``."""
    needs: dict[str, str] = {}
    softmax_target = model.target_attention and model.target_normalization == SOFTMAX
    full_attention = [name for name, used in (
        ("model.target_attention", softmax_target),
        ("model.pma_queries", model.pma_queries > 0),
        ("model.cross_attention", model.cross_attention and model.num_layers > 0)) if used]
    if full_attention:  # these attend with softmax whatever the sequence layers use
        needs[SOFTMAX] = f"{', '.join(full_attention)} ({SOFTMAX} attention)"
    if model.target_attention and model.target_normalization != SOFTMAX:
        needs[model.target_normalization] = (
            f"model.target_normalization = {model.target_normalization}")
    if model.num_layers > 0:
        needs[model.normalization] = f"model.normalization = {model.normalization}"
        if model.relative_bias:
            needs[RELATIVE_BIAS] = "model.relative_bias = true"
    if compile:
        needs[TORCH_COMPILE] = "train.compile"
    if export:
        needs[TORCH_EXPORT] = "gem export-model"
    return needs


def check_attention_backend(model: ModelConfig, spec: ImplementationSpec,
                            installed: Sequence[ImplementationSpec], *, compile: bool = False,
                            export: bool = False) -> None:
    """Raise ``GemConfigError`` (one line) when ``spec`` does not declare a capability the run
    needs (:func:`attention_needs`), naming the backend, the capability, the setting and the
    installed backends that declare every capability the run needs."""
    if compile and model.relative_bias:
        # Each block builds a frozen attrs RelativeBias inside its forward, and dynamo cannot
        # trace attrs' object.__setattr__: every backend would fail at the first step instead.
        raise GemConfigError(
            "train.compile does not support model.relative_bias yet (the bias object is built "
            "inside the compiled block, which torch.compile cannot trace); set "
            "train.compile=false or model.relative_bias=false")
    needs = attention_needs(model, compile=compile, export=export)
    for capability, setting in needs.items():
        if capability in spec.capabilities:
            continue
        what = (f"normalization {capability}" if capability in NORMALIZATIONS
                else capability)
        raise GemConfigError(
            f"attention backend {spec.name!r} does not support {what} (needed by {setting}); "
            f"backends that do: {declared_by(installed, *needs)}")
