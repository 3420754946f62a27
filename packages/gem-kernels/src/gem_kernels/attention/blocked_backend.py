"""The ``blocked`` backend object handed to the model: eager calls run the tiled computation
(:mod:`gem_kernels.attention.blocked_tiles`, where the method is described); under
``torch.compile`` each call is one custom op (:mod:`gem_kernels.attention.blocked_op`) running the
same code, so a compiled block keeps one graph."""

from __future__ import annotations

import torch

from gem_core.contracts import AttentionBackend
from gem_kernels.attention.blocked_op import blocked_attention_op
from gem_kernels.attention.blocked_tiles import auto_block, blocked_attention

__all__ = ["BlockedAttention", "auto_block", "blocked_attention"]


class BlockedAttention(AttentionBackend):
    """The ``blocked`` backend object handed to the model."""

    name = "blocked"

    def __init__(self, block_q: int | None = None, block_k: int | None = None) -> None:
        for label, size in (("block_q", block_q), ("block_k", block_k)):
            if size is not None and size < 1:
                raise ValueError(f"{label} must be None (automatic) or >= 1, got {size}")
        self.block_q, self.block_k = block_q, block_k

    def __call__(self, q, k, v, q_offsets, kv_offsets, *, params, num_targets=None,
                 max_q_len=None, max_kv_len=None, bias=None):
        if torch.compiler.is_compiling():
            # One opaque custom op instead of a graph break at the tile loop; the op validates
            # its inputs when it runs.
            return blocked_attention_op(q, k, v, q_offsets, kv_offsets, params=params,
                                        num_targets=num_targets, block_q=self.block_q,
                                        block_k=self.block_k, bias=bias)
        return blocked_attention(q, k, v, q_offsets, kv_offsets, params=params,
                                 num_targets=num_targets, block_q=self.block_q,
                                 block_k=self.block_k, bias=bias)
