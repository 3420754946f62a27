"""The attention call signature every backend implements, and its parameters."""

from __future__ import annotations

import math
from typing import Literal

import attrs
import torch
from torch import Tensor

from gem_core.attention.relative_bias import RelativeBias
from gem_core.capabilities import NORMALIZATIONS, RELATIVE_BIAS, WHO_DECLARES
from gem_core.jagged import check_offsets

Normalization = Literal["softmax", "silu"]


def _non_negative_or_none(instance: object, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None and value < 0:
        raise ValueError(f"{attribute.name} must be None or >= 0, got {value}")


@attrs.frozen(kw_only=True)
class AttentionParams:
    """What to compute; the same for every backend. See :mod:`gem_core.attention.masks`."""

    causal: bool = False
    """Self-attention only: a history token sees itself and earlier history tokens only."""

    window: int | None = attrs.field(default=None, validator=_non_negative_or_none)
    """Self-attention only: a history token sees at most ``window`` earlier history tokens (and
    itself); a target token sees the last ``window`` history tokens. None means unlimited."""

    num_prefix: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """Self-attention only: the first ``num_prefix`` tokens of each sequence are contextual: they
    see the whole history and every token sees them, regardless of causality and window."""

    normalization: Normalization = attrs.field(
        default="softmax", validator=attrs.validators.in_(NORMALIZATIONS)
    )
    """``softmax`` or HSTU-style pointwise ``silu(scale * q.k) / n`` with ``n`` the number of keys
    of the sample (not the batch maximum, so a sample's output never depends on its batch)."""

    scale: float | None = None
    """Multiplier of ``q.k``; None means ``1 / sqrt(head_dim)``."""

    @property
    def is_self_attention_only(self) -> bool:
        return self.causal or self.window is not None or self.num_prefix > 0

    def resolved_scale(self, head_dim: int) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(head_dim)


# A run never calls a backend with what it does not declare: the start-up check
# (:func:`gem_core.attention.choice.check_attention_backend`) refuses it first, naming the
# backends that declare it, from the registry. These two are what a backend still raises when
# called directly, so that it never computes something else silently.


def reject_unsupported_bias(backend: str, bias: RelativeBias | None) -> None:
    """What a backend without the ``relative_bias`` capability calls first: raise if given one."""
    if bias is not None:
        raise NotImplementedError(
            f"the {backend} attention backend does not support {RELATIVE_BIAS} (a RelativeBias "
            f"was passed); use a backend that declares {RELATIVE_BIAS} ({WHO_DECLARES})"
        )


def reject_unsupported_normalization(backend: str, params: AttentionParams,
                                     computes: tuple[str, ...]) -> None:
    """Raise unless the backend named ``backend`` computes ``params.normalization`` (one of
    ``computes``, the normalisations its registration declares)."""
    if params.normalization not in computes:
        raise NotImplementedError(
            f"the {backend} attention backend computes {', '.join(computes)} attention only, not "
            f"{params.normalization!r}; use a backend that declares {params.normalization} "
            f"({WHO_DECLARES})"
        )


def needs_self_attention(params: AttentionParams, num_targets: Tensor | None,
                         bias: RelativeBias | None = None) -> bool:
    """Whether the call is self-attention in the sense that changes the result: causality, a
    window, contextual prefix or target tokens, or a relative bias. Without any of them,
    attention within each sample is the same whether or not q and k/v share offsets, so backends
    need not compare them (a comparison of values is a device sync on a GPU)."""
    return params.is_self_attention_only or num_targets is not None or bias is not None


def _check_same_offsets(q_offsets: Tensor, kv_offsets: Tensor) -> None:
    message = ("causal, window, num_prefix, num_targets and a relative bias need self-attention "
               "(q_offsets equal to kv_offsets)")
    if q_offsets is kv_offsets:
        return
    if q_offsets.shape != kv_offsets.shape:
        raise ValueError(message)
    if q_offsets.device.type != "cpu":
        torch._assert_async((q_offsets == kv_offsets).all(), message)
    elif not torch.equal(q_offsets, kv_offsets):
        raise ValueError(message)


def validate_attention_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_offsets: Tensor,
    kv_offsets: Tensor,
    params: AttentionParams,
    num_targets: Tensor | None,
    bias: RelativeBias | None = None,
) -> None:
    """Raise ValueError with a one-sentence reason for inputs no backend should accept."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k, v must be (tokens, heads, head_dim), got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if k.shape != v.shape or q.shape[1:] != k.shape[1:]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree")
    check_offsets(q_offsets, q.shape[0], "q_offsets")
    check_offsets(kv_offsets, k.shape[0], "kv_offsets")
    if q_offsets.numel() != kv_offsets.numel():
        raise ValueError(
            f"q_offsets has {q_offsets.numel() - 1} samples but kv_offsets has "
            f"{kv_offsets.numel() - 1}"
        )
    if needs_self_attention(params, num_targets, bias):
        _check_same_offsets(q_offsets, kv_offsets)
    if bias is not None:
        if not isinstance(bias, RelativeBias):
            raise TypeError(f"bias must be a RelativeBias, got {type(bias).__name__}")
        bias.check(q.shape[0], q.shape[1], q.device)
    if num_targets is not None:
        if num_targets.shape != (q_offsets.numel() - 1,):
            raise ValueError(
                f"num_targets must have one entry per sample ({q_offsets.numel() - 1}), got "
                f"{tuple(num_targets.shape)}"
            )
        lengths = q_offsets[1:] - q_offsets[:-1]
        bad = (num_targets < 0) | (num_targets > lengths)
        if num_targets.device.type != "cpu":  # no host sync on an accelerator (check_offsets)
            torch._assert_async(~bad.any(), "num_targets must lie in [0, sequence length]")
        elif bool(bad.any()):
            row = int(torch.nonzero(bad)[0])
            raise ValueError(
                f"num_targets[{row}] = {int(num_targets[row])} is outside [0, {int(lengths[row])}]"
            )
