"""The attention mask, defined once, in the plainest form. Every backend must agree with it.

For a self-attention sequence of ``L`` tokens whose last ``T`` are targets (``H = L - T`` history
tokens, the first ``P`` of which are contextual prefix tokens), query ``i`` may see key ``j`` when:

* ``j`` is a target: only ``j == i`` (targets see themselves, never each other);
* ``j`` is a prefix token, or ``i`` is a prefix token: always (when ``j`` is history);
* otherwise, with ``pos(i) = i`` for history and ``pos(i) = H`` for targets (a target sits just
  after the history): ``j <= pos(i)`` when causal (targets never see a later target), and
  ``pos(i) - j <= window`` when a window is set (``|pos(i) - j| <= window`` if not causal).

Cross-attention and PMA (different offsets for q and kv): every query sees every key of its sample.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gem_core.attention.api import AttentionParams


def visible(i: Tensor, j: Tensor, length: Tensor, num_targets: Tensor,
            params: AttentionParams) -> Tensor:
    """Elementwise form of the rule above: whether query position ``i`` sees key position ``j``
    in a sequence of ``length`` tokens whose last ``num_targets`` are targets. Every argument is
    an integer tensor and they broadcast; positions at or past ``length`` are never visible."""
    history = length - num_targets
    query_pos = torch.where(i < history, i, history)
    allowed = torch.ones(torch.broadcast_shapes(i.shape, j.shape, length.shape),
                         dtype=torch.bool, device=i.device)
    if params.causal:
        allowed = allowed & (j <= query_pos)
    if params.window is not None:
        distance = query_pos - j
        allowed = allowed & ((distance <= params.window) if params.causal
                             else (distance.abs() <= params.window))
    prefix = params.num_prefix
    if prefix > 0:
        # Prefix keys are seen by every query; prefix queries see every history key.
        allowed = allowed | ((j < history) & ((j < prefix) | ((i < prefix) & (i < history))))
    allowed = torch.where(j >= history, i == j, allowed)  # targets: only themselves
    return allowed & (i < length) & (j < length)


def self_attention_masks(
    lengths: Tensor, num_targets: Tensor, params: AttentionParams, width: int
) -> Tensor:
    """Boolean ``(B, width, width)`` masks for sequences padded to ``width``: ``mask[b, i, j]`` is
    True when query ``i`` of sample ``b`` sees key ``j``. Padding rows and columns are False."""
    idx = torch.arange(width, device=lengths.device)
    return visible(idx[None, :, None], idx[None, None, :], lengths.to(torch.int64)[:, None, None],
                   num_targets.to(torch.int64)[:, None, None], params)


def self_attention_mask(
    length: int, num_targets: int, params: AttentionParams, device: torch.device | None = None
) -> Tensor:
    """Boolean ``(length, length)`` mask of one sample (see :func:`self_attention_masks`)."""
    lengths = torch.tensor([length], device=device)
    targets = torch.tensor([num_targets], device=device)
    return self_attention_masks(lengths, targets, params, length)[0]


def count_visible_keys(
    length: int, num_targets: int, params: AttentionParams, num_keys: int | None = None
) -> int:
    """How many (query, key) pairs are computed for one sample: the true attention work."""
    if num_keys is not None:
        return length * num_keys
    return int(self_attention_mask(length, num_targets, params).sum())
