"""What a model asks of its attention backend, checked at start-up against what the backend's
registration declares (``ImplementationSpec.capabilities``), so a run that cannot work stops
before anything is built, with one line naming the backend, what it lacks and who has it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from gem_core.capabilities import NORMALIZATIONS, RELATIVE_BIAS, SOFTMAX
from gem_core.errors import GemConfigError

if TYPE_CHECKING:
    from gem_core.config import ModelConfig
    from gem_core.registry import ImplementationSpec



def attention_needs(model: ModelConfig) -> dict[str, str]:
    """Each capability the model's attention calls need, with the setting that needs it."""
    needs: dict[str, str] = {}
    softmax_target = model.target_attention and model.target_normalization == "softmax"
    full_attention = [name for name, used in (
        ("model.target_attention", softmax_target),
        ("model.pma_queries", model.pma_queries > 0),
        ("model.cross_attention", model.cross_attention and model.num_layers > 0)) if used]
    if full_attention:  # these attend with softmax whatever the sequence layers use
        needs[SOFTMAX] = f"{', '.join(full_attention)} (softmax attention)"
    if model.target_attention and model.target_normalization != "softmax":
        needs[model.target_normalization] = (
            f"model.target_normalization = {model.target_normalization}")
    if model.num_layers > 0:
        needs[model.normalization] = f"model.normalization = {model.normalization}"
        if model.relative_bias:
            needs[RELATIVE_BIAS] = "model.relative_bias = true"
    return needs


def check_attention_backend(model: ModelConfig, spec: ImplementationSpec,
                            installed: Sequence[ImplementationSpec]) -> None:
    """Raise ``GemConfigError`` (one line) when ``spec`` does not declare a capability the
    model needs, naming the backend, the capability, the setting and the installed backends
    that declare it."""
    for capability, setting in attention_needs(model).items():
        if capability in spec.capabilities:
            continue
        able = [other.name for other in installed if capability in other.capabilities]
        what = (f"normalization {capability}" if capability in NORMALIZATIONS
                else capability)
        raise GemConfigError(
            f"attention backend {spec.name!r} does not support {what} (needed by {setting}); "
            f"backends that do: {', '.join(able) or 'none installed'}")
