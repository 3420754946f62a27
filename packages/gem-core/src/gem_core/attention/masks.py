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


def self_attention_mask(
    length: int, num_targets: int, params: AttentionParams, device: torch.device | None = None
) -> Tensor:
    """Boolean ``(length, length)`` mask: ``mask[i, j]`` is True when query ``i`` sees key ``j``."""
    history = length - num_targets
    idx = torch.arange(length, device=device)
    i = idx[:, None]
    j = idx[None, :]
    query_pos = torch.where(i < history, i, torch.full_like(i, history))
    allowed = torch.ones(length, length, dtype=torch.bool, device=device)
    if params.causal:
        allowed &= j <= query_pos
    if params.window is not None:
        distance = query_pos - j
        allowed &= (distance <= params.window) if params.causal else (distance.abs() <= params.window)
    prefix = params.num_prefix
    if prefix > 0:
        # Prefix keys are seen by every query; prefix queries see every history key.
        allowed |= (j < history) & ((j < prefix) | ((i < prefix) & (i < history)))
    key_is_target = j >= history
    allowed = torch.where(key_is_target, i == j, allowed)
    return allowed


def count_visible_keys(
    length: int, num_targets: int, params: AttentionParams, num_keys: int | None = None
) -> int:
    """How many (query, key) pairs are computed for one sample: the true attention work."""
    if num_keys is not None:
        return length * num_keys
    return int(self_attention_mask(length, num_targets, params).sum())
