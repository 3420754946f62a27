"""HSTU-style relative attention bias: learned per-head weights indexed by the relative position and
the (log-bucketed) time difference of a query and a key of the same sample.

Self-attention only (``q_offsets`` equal to ``kv_offsets``). For query ``i`` and key ``j`` of one
sample (positions counted from the sample's first token) and head ``h`` the bias is::

    bias[h, i, j] = position_weights[h, position_bucket(pos(i) - pos(j))]
                    + time_weights[h, time_bucket(timestamps[i] - timestamps[j])]   # if set

and it is added to the score ``scale * q.k`` before the softmax or SiLU normalisation (masked pairs
stay masked). ``pos`` is the position of :mod:`gem_core.attention.masks`: ``pos(x) = x`` for
history tokens (contextual prefix tokens included) and ``pos(x) = H`` (the history length) for
the target tokens at the tail, which sit "just after the history", so a target's bias never
depends on how many other targets its sample holds (a target sees only itself among the targets,
at distance 0).

The two bucket functions below are the definition; every PyTorch backend calls them, and the
Triton kernels compute the same formulas (in float32, like :func:`time_bucket`):

* ``position_bucket(d) = min(|d|, num_position_buckets - 1)``: symmetric, so non-causal attention
  (and a contextual prefix query looking at later history keys) uses the same weight for ``d``
  and ``-d``; distances of ``num_position_buckets - 1`` or more share the last bucket.
* ``time_bucket(dt) = min(floor(ln(max(1, |dt|)) / time_bucket_divisor), num_time_buckets - 1)``
  with ``dt = timestamps[query] - timestamps[key]`` in seconds (int64) and the logarithm taken in
  float32. The default divisor 0.301 is HSTU's. Backends may disagree only where
  ``ln|dt| / divisor`` lies within float32 rounding of an integer (none for ``|dt| <= 10**4``
  at the default divisor).
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

#: HSTU's divisor of the natural logarithm of the time difference.
DEFAULT_TIME_BUCKET_DIVISOR = 0.301


def _tensor_or_none(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None and not isinstance(value, Tensor):
        raise TypeError(f"RelativeBias.{attribute.name} must be a Tensor or None, got "
                        f"{type(value).__name__}")


@attrs.frozen(kw_only=True, eq=False)
class RelativeBias:
    """The learned relative bias of one self-attention call (see the module docstring).

    The weights are usually ``nn.Parameter`` s of the model's attention layer; every backend that
    declares the ``relative_bias`` capability returns gradients for them. ``timestamps`` is the
    only per-batch tensor.
    """

    position_weights: Tensor = attrs.field(validator=attrs.validators.instance_of(Tensor))
    """``(heads, num_position_buckets)`` float: bias by relative-position bucket."""

    time_weights: Tensor | None = attrs.field(default=None, validator=_tensor_or_none)
    """``(heads, num_time_buckets)`` float, or None for no time bias."""

    timestamps: Tensor | None = attrs.field(default=None, validator=_tensor_or_none)
    """int64 ``(total_tokens,)``, seconds, one per token of the jagged batch (the same layout as
    ``q``); required with ``time_weights``, None without."""

    time_bucket_divisor: float = attrs.field(default=DEFAULT_TIME_BUCKET_DIVISOR)
    """``a`` of ``time_bucket = floor(ln(max(1, |dt|)) / a)``; > 0."""

    def __attrs_post_init__(self) -> None:
        if self.position_weights.dim() != 2 or self.position_weights.shape[1] < 1:
            raise ValueError("RelativeBias.position_weights must be (heads, num_position_buckets)"
                             f" with at least one bucket, got {tuple(self.position_weights.shape)}")
        if (self.time_weights is None) != (self.timestamps is None):
            raise ValueError("RelativeBias needs time_weights and timestamps together (or "
                             "neither)")
        if self.time_weights is not None:
            if self.time_weights.dim() != 2 or self.time_weights.shape[1] < 1:
                raise ValueError("RelativeBias.time_weights must be (heads, num_time_buckets) "
                                 f"with at least one bucket, got {tuple(self.time_weights.shape)}")
            if self.time_weights.shape[0] != self.position_weights.shape[0]:
                raise ValueError(
                    f"RelativeBias.time_weights has {self.time_weights.shape[0]} heads but "
                    f"position_weights has {self.position_weights.shape[0]}")
            if self.timestamps.dim() != 1 or self.timestamps.dtype.is_floating_point:
                raise ValueError("RelativeBias.timestamps must be an integer (int64) tensor of "
                                 f"shape (total_tokens,), got {self.timestamps.dtype} "
                                 f"{tuple(self.timestamps.shape)}")
        if not self.time_bucket_divisor > 0:
            raise ValueError(f"RelativeBias.time_bucket_divisor must be > 0, got "
                             f"{self.time_bucket_divisor}")

    @property
    def heads(self) -> int:
        return self.position_weights.shape[0]

    @property
    def num_position_buckets(self) -> int:
        return self.position_weights.shape[1]

    @property
    def num_time_buckets(self) -> int:
        return 0 if self.time_weights is None else self.time_weights.shape[1]

    def check(self, total_tokens: int, heads: int, device: torch.device) -> None:
        """Raise ValueError unless the bias fits a call with ``total_tokens`` query tokens and
        ``heads`` heads on ``device`` (shapes and devices only: no device sync)."""
        if self.heads != heads:
            raise ValueError(f"RelativeBias has {self.heads} heads but q has {heads}")
        if self.timestamps is not None and self.timestamps.shape[0] != total_tokens:
            raise ValueError(f"RelativeBias.timestamps has {self.timestamps.shape[0]} entries "
                             f"but the batch has {total_tokens} tokens")
        for name in ("position_weights", "time_weights", "timestamps"):
            t = getattr(self, name)
            if t is not None and t.device.type != device.type:
                raise ValueError(f"RelativeBias.{name} is on {t.device}, q on {device}")


def position_bucket(distance: Tensor, num_buckets: int) -> Tensor:
    """``min(|distance|, num_buckets - 1)`` as int64 (see the module docstring)."""
    return distance.abs().clamp(max=num_buckets - 1).to(torch.int64)


def time_bucket(dt: Tensor, num_buckets: int, divisor: float = DEFAULT_TIME_BUCKET_DIVISOR
                ) -> Tensor:
    """``min(floor(ln(max(1, |dt|)) / divisor), num_buckets - 1)`` as int64, the logarithm in
    float32 (what the Triton kernels compute too)."""
    magnitude = dt.abs().clamp(min=1).to(torch.float32)
    return torch.floor(torch.log(magnitude) / divisor).to(torch.int64).clamp(max=num_buckets - 1)


def bias_positions(index: Tensor, length: Tensor, num_targets: Tensor) -> Tensor:
    """``pos`` of the module docstring: the index within the sample, with every target token
    (the last ``num_targets`` of ``length``) at the history length. Broadcasts."""
    return torch.minimum(index, length - num_targets)


def relative_bias_values(bias: RelativeBias, query_pos: Tensor, key_pos: Tensor,
                         query_token: Tensor | None = None, key_token: Tensor | None = None
                         ) -> Tensor:
    """The bias of (query, key) pairs, heads first: ``(heads, *shape)`` for the broadcast
    ``shape`` of the arguments. ``*_pos`` are :func:`bias_positions`; ``*_token`` index
    ``bias.timestamps`` (needed only with time weights; they must be valid indices, so clamp
    padding). Differentiable in the weights."""
    values = bias.position_weights[:, position_bucket(query_pos - key_pos,
                                                      bias.num_position_buckets)]
    if bias.time_weights is not None:
        if query_token is None or key_token is None:
            raise ValueError("a RelativeBias with time_weights needs the token indices")
        dt = bias.timestamps[query_token] - bias.timestamps[key_token]
        values = values + bias.time_weights[:, time_bucket(dt, bias.num_time_buckets,
                                                           bias.time_bucket_divisor)]
    return values
