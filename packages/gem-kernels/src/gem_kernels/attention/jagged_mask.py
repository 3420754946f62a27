"""The attention mask of :mod:`gem_core.attention.masks`, vectorised over a whole jagged batch.

``masks.self_attention_mask`` builds one sample at a time (the plain definition); this builds the
``(total_q, max_kv_len)`` mask of every query row against the (padded) keys of its own sample in a
few tensor ops, for backends that work on a jagged query side. Tested against the definition.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gem_core.attention.api import AttentionParams
from gem_core.jagged import lengths_from_offsets, positions_in_row, row_ids


def jagged_visible_mask(
    q_offsets: Tensor, kv_offsets: Tensor, max_kv_len: int, params: AttentionParams,
    num_targets: Tensor | None, is_self: bool,
) -> Tensor:
    """Boolean ``(total_q, max_kv_len)``: row ``t`` (query ``i`` of sample ``b``) sees key ``j``."""
    rows = row_ids(q_offsets)
    kv_len = lengths_from_offsets(kv_offsets)[rows][:, None]
    j = torch.arange(max_kv_len, device=q_offsets.device)[None, :]
    in_sample = j < kv_len
    if not is_self:
        return in_sample  # cross-attention and PMA: every key of the sample
    i = positions_in_row(q_offsets)[:, None]
    targets = num_targets[rows][:, None] if num_targets is not None else torch.zeros_like(kv_len)
    history = kv_len - targets
    pos = torch.minimum(i, history)  # a target query sits just after the history
    allowed = torch.ones_like(in_sample)
    if params.causal:
        allowed &= j <= pos
    if params.window is not None:
        distance = pos - j
        allowed &= (distance <= params.window) if params.causal else (
            distance.abs() <= params.window)
    if params.num_prefix > 0:
        prefix = params.num_prefix
        allowed |= (j < history) & ((j < prefix) | ((i < prefix) & (i < history)))
    allowed = torch.where(j >= history, i == j, allowed)
    return allowed & in_sample
