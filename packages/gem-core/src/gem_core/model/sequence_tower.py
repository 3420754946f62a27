"""The upstream sequence tower: jagged self-attention layers over the user history."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gem_core.attention import AttentionParams, RelativeBias
from gem_core.config import MoeConfig
from gem_core.contracts import AttentionBackend
from gem_core.errors import GemConfigError
from gem_core.flops import attention_flops, linear_layer_flops, self_attention_pairs
from gem_core.model.cross_attention import CrossFeatureAttention
from gem_core.model.moe import build_moe, mlp_flops
from gem_core.norm import NormBackend


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


#: Relative-position buckets of the relative attention bias: distances 0 .. 127, the rest share
#: the last (a local window is usually shorter).
RELATIVE_POSITION_BUCKETS = 128
#: Time-difference buckets: floor(ln(seconds) / 0.301) reaches 57 at a year.
RELATIVE_TIME_BUCKETS = 64


class JaggedSelfAttentionBlock(nn.Module):
    """Pre-norm block: jagged causal (windowed) self-attention, then a SwiGLU MLP (or a
    mixture of SwiGLU experts when ``moe`` is given). With ``norm`` (a gated-norm backend) the
    attention output is gated HSTU-style: ``LayerNorm(attended) * silu(u)``, ``u`` a fourth
    projection of the input. With ``relative_bias`` the scores get HSTU's learned bias per head
    by relative position and time-difference bucket (:class:`~gem_core.attention.RelativeBias`),
    initialised at zero so training starts from the unbiased layer."""

    def __init__(self, dim: int, heads: int, mlp_hidden: int, params: AttentionParams,
                 attention: AttentionBackend, moe: MoeConfig | None = None,
                 norm: NormBackend | None = None, relative_bias: bool = False) -> None:
        super().__init__()
        self.position_bias = (nn.Parameter(torch.zeros(heads, RELATIVE_POSITION_BUCKETS))
                              if relative_bias else None)
        self.time_bias = (nn.Parameter(torch.zeros(heads, RELATIVE_TIME_BUCKETS))
                          if relative_bias else None)
        self.heads, self.params, self.attention = heads, params, attention
        self.norm_backend = norm
        self.attn_norm = nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, (4 if norm is not None else 3) * dim, bias=False)
        self.gate_norm = nn.LayerNorm(dim) if norm is not None else None
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.RMSNorm(dim)
        self.mlp = (build_moe(moe, "swiglu", dim, mlp_hidden, dim) if moe is not None
                    else SwiGLU(dim, mlp_hidden))

    def forward(self, x: Tensor, offsets: Tensor, max_len: int,
                timestamps: Tensor | None = None) -> Tensor:
        """``timestamps``: ``(tokens,)`` event times, needed with the relative bias."""
        tokens, dim = x.shape
        parts = self.qkv(self.attn_norm(x))
        if self.gate_norm is not None:
            parts, u = parts[:, : 3 * dim], parts[:, 3 * dim:]
        # Indexing, not unbind: under torch.export unbind's split would specialise the program
        # to more than one history event.
        qkv = parts.reshape(tokens, 3, self.heads, dim // self.heads)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        bias = None
        if self.position_bias is not None:
            if timestamps is None:
                raise GemConfigError("model.relative_bias needs the events' timestamps")
            bias = RelativeBias(position_weights=self.position_bias, time_weights=self.time_bias,
                                timestamps=timestamps)
        attended = self.attention(q, k, v, offsets, offsets, params=self.params,
                                  max_q_len=max_len, max_kv_len=max_len,
                                  **({"bias": bias} if bias is not None else {})
                                  ).reshape(tokens, dim)
        if self.gate_norm is not None:
            attended = self.norm_backend.gated_norm(
                attended, F.silu(u), self.gate_norm.weight, self.gate_norm.bias, kind="layer",
                eps=self.gate_norm.eps)
        x = x + self.proj(attended)
        return x + self.mlp(self.mlp_norm(x))

    def flops(self, lengths: Tensor, dense: bool) -> dict[str, int]:
        """Forward FLOPs (matmuls only) over histories of these lengths; ``dense`` counts every
        sample's full square, as the reference backend computes it."""
        pairs = self_attention_pairs(lengths, self.params.causal, self.params.window, dense)
        tokens = int(lengths.sum())
        # Every nn.Linear of the block, the MLP slot as it counts itself (an MoE: its active
        # experts only, not every expert's weights).
        linear = (linear_layer_flops(self, tokens) - linear_layer_flops(self.mlp, tokens)
                  + mlp_flops(self.mlp, tokens))
        return {"linear": linear,
                "attention": attention_flops(pairs, self.qkv.in_features)}


class SequenceTower(nn.Module):
    """A stack of jagged self-attention blocks, each optionally followed by cross-attention to
    the sample's non-sequence context tokens; the output is candidate-independent.

    The cross-attention layers live in their own list (``cross``) so that every entry of
    ``blocks`` keeps the ``(x, offsets, max_len) -> x`` form that activation checkpointing wraps.
    """

    def __init__(self, dim: int, heads: int, layers: int, mlp_hidden: int,
                 params: AttentionParams, attention: AttentionBackend,
                 cross_attention: bool = False, moe: MoeConfig | None = None,
                 gate_norm: NormBackend | None = None, relative_bias: bool = False) -> None:
        """``gate_norm``: gate every attention output through this norm backend (None: no
        gate); ``relative_bias``: HSTU's relative attention bias in every block."""
        super().__init__()
        self.blocks = nn.ModuleList(
            JaggedSelfAttentionBlock(dim, heads, mlp_hidden, params, attention, moe, gate_norm,
                                     relative_bias)
            for _ in range(layers)
        )
        self.cross = nn.ModuleList(
            CrossFeatureAttention(dim, heads, attention) for _ in range(layers if cross_attention
                                                                        else 0)
        )
        self.norm = nn.RMSNorm(dim)

    def forward(self, x: Tensor, offsets: Tensor, max_len: int,
                context: Tensor | None = None, timestamps: Tensor | None = None) -> Tensor:
        """``context``: ``(B, C, d)`` non-sequence tokens, needed when ``cross`` is not empty;
        ``timestamps``: the events' times, needed by the relative bias."""
        for i, block in enumerate(self.blocks):
            x = (block(x, offsets, max_len, timestamps=timestamps)
                 if block.position_bias is not None else block(x, offsets, max_len))
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
