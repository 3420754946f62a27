"""The upstream sequence tower: jagged self-attention layers over the user history."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from gem_core.attention import AttentionBackend, AttentionParams


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


class SequenceTower(nn.Module):
    """A stack of jagged self-attention blocks; the output is candidate-independent."""

    def __init__(self, dim: int, heads: int, layers: int, mlp_hidden: int,
                 params: AttentionParams, attention: AttentionBackend) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            JaggedSelfAttentionBlock(dim, heads, mlp_hidden, params, attention)
            for _ in range(layers)
        )
        self.norm = nn.RMSNorm(dim)

    def forward(self, x: Tensor, offsets: Tensor, max_len: int) -> Tensor:
        for block in self.blocks:
            x = block(x, offsets, max_len)
        return self.norm(x)
