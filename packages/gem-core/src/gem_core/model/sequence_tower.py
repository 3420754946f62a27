"""The upstream sequence tower: jagged self-attention layers over the user history."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from gem_core.attention import AttentionBackend, AttentionParams
from gem_core.flops import attention_flops, linear_layer_flops, self_attention_pairs
from gem_core.model.cross_attention import CrossFeatureAttention


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class JaggedSelfAttentionBlock(nn.Module):
    """Pre-norm block: jagged causal (windowed) self-attention, then a SwiGLU MLP."""

    def __init__(self, dim: int, heads: int, mlp_hidden: int, params: AttentionParams,
                 attention: AttentionBackend) -> None:
        super().__init__()
        self.heads, self.params, self.attention = heads, params, attention
        self.attn_norm = nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.RMSNorm(dim)
        self.mlp = SwiGLU(dim, mlp_hidden)

    def forward(self, x: Tensor, offsets: Tensor, max_len: int) -> Tensor:
        tokens, dim = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(tokens, 3, self.heads, dim // self.heads).unbind(1)
        attended = self.attention(q, k, v, offsets, offsets, params=self.params,
                                  max_q_len=max_len, max_kv_len=max_len)
        x = x + self.proj(attended.reshape(tokens, dim))
        return x + self.mlp(self.mlp_norm(x))

    def flops(self, lengths: Tensor, dense: bool) -> dict[str, int]:
        """Forward FLOPs (matmuls only) over histories of these lengths; ``dense`` counts every
        sample's full square, as the reference backend computes it."""
        pairs = self_attention_pairs(lengths, self.params.causal, self.params.window, dense)
        return {"linear": linear_layer_flops(self, int(lengths.sum())),
                "attention": attention_flops(pairs, self.qkv.in_features)}


class SequenceTower(nn.Module):
    """A stack of jagged self-attention blocks, each optionally followed by cross-attention to
    the sample's non-sequence context tokens; the output is candidate-independent.

    The cross-attention layers live in their own list (``cross``) so that every entry of
    ``blocks`` keeps the ``(x, offsets, max_len) -> x`` form that activation checkpointing wraps.
    """

    def __init__(self, dim: int, heads: int, layers: int, mlp_hidden: int,
                 params: AttentionParams, attention: AttentionBackend,
                 cross_attention: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            JaggedSelfAttentionBlock(dim, heads, mlp_hidden, params, attention)
            for _ in range(layers)
        )
        self.cross = nn.ModuleList(
            CrossFeatureAttention(dim, heads, attention) for _ in range(layers if cross_attention
                                                                        else 0)
        )
        self.norm = nn.RMSNorm(dim)

    def forward(self, x: Tensor, offsets: Tensor, max_len: int,
                context: Tensor | None = None) -> Tensor:
        """``context``: ``(B, C, d)`` non-sequence tokens, needed when ``cross`` is not empty."""
        for i, block in enumerate(self.blocks):
            x = block(x, offsets, max_len)
            if len(self.cross):
                x = self.cross[i](x, offsets, max_len, context)
        return self.norm(x)

    def flops(self, lengths: Tensor, num_context: int, dense: bool) -> dict[str, int]:
        totals = {"linear": 0, "attention": 0}
        counts = [block.flops(lengths, dense) for block in self.blocks]
        counts += [cross.flops(lengths, num_context) for cross in self.cross]
        for count in counts:
            for key, value in count.items():
                totals[key] += value
        return totals
