"""``blocked``: jagged attention over the packed token stream, through PyTorch's fused SDPA.

The samples stay concatenated as they arrive: nothing is padded to a batch maximum. The stream of
queries is cut into tiles of ``block_q`` tokens. Every query of a tile can see only a contiguous
span of keys (its sample's keys, cut further by causality and the local window), so each tile
gathers that one span; tiles are grouped by span width, rounded up a quarter octave in units of
``block_k``, and each group runs as one batched call of the fused SDPA kernel with the exact
mask (or batched matmuls for SiLU). Short samples share a tile instead of each padding their own,
and a windowed tile reads about ``block_q + window`` keys, not its whole history. Plain causal
softmax takes a second path: whole samples grouped by length through SDPA's ``is_causal``
kernel, which needs no mask tensor.

This module is the eager computation. Under ``torch.compile`` each call is one custom op
(:mod:`gem_kernels.attention.blocked_op`) running this same code, so a compiled block keeps one
graph; the backend object that chooses between them is :mod:`gem_kernels.attention.blocked_backend`.

Autograd differentiates it and there is no custom kernel, so it runs wherever PyTorch does. It is
the fast CPU backend (``auto`` there): a few dozen batched fused calls per layer, where
per-sample backends pay a call per sample and padded SDPA pays for the padding. Measured figures
are in ``docs/perf.md``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from gem_core.attention.api import AttentionParams
from gem_core.attention.masks import visible
from gem_core.attention.relative_bias import RelativeBias, bias_positions, relative_bias_values
from gem_kernels.attention.common import checked_inputs

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
MIN_BLOCK, MAX_BLOCK = 8, 64


def auto_block(total_tokens: int, samples_with_tokens: int, window: int | None = None) -> int:
    """A power-of-two tile size near the mean sample length (and half the window), so tiles of
    short samples are not mostly empty and long samples still get GEMM-sized tiles."""
    mean = total_tokens / max(samples_with_tokens, 1)
    target = min(mean, window / 2) if window else mean
    size = MIN_BLOCK
    while size < target and size < MAX_BLOCK:
        size *= 2
    return size


class _GatherTiles(torch.autograd.Function):
    """``tiles.index_select(0, index)`` whose backward is one ``index_add_`` of the contiguous
    gradient: on a CPU several times faster than autograd's own backward of index_select (an
    element-wise scatter), which was a fifth of this backend's time. Forward and context set-up
    are separate so that :func:`torch.func.vjp` can differentiate it (the compiled path's
    backward, :mod:`gem_kernels.attention.blocked_op`)."""

    @staticmethod
    def forward(tiles: Tensor, index: Tensor) -> Tensor:
        return tiles.index_select(0, index)

    @staticmethod
    def setup_context(ctx, inputs: tuple[Tensor, Tensor], output: Tensor) -> None:
        tiles, index = inputs
        ctx.save_for_backward(index)
        ctx.num_tiles = tiles.shape[0]

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (index,) = ctx.saved_tensors
        out = grad.new_zeros((ctx.num_tiles, *grad.shape[1:]))
        return out.index_add_(0, index, grad.contiguous()), None


def _gather(tiles: Tensor, index: Tensor) -> Tensor:
    return _GatherTiles.apply(tiles, index)


class _Stream:
    """One side (queries or keys) of the call, packed and cut into tiles."""

    def __init__(self, x: Tensor, offsets: Tensor, block: int, compute: torch.dtype) -> None:
        self.total, self.block = x.shape[0], block
        self.lengths = offsets[1:] - offsets[:-1]
        self.sample = torch.repeat_interleave(
            torch.arange(self.lengths.numel(), device=x.device), self.lengths)
        self.tiles = -(-self.total // block)
        pad = self.tiles * block - self.total
        heads, dim = x.shape[1:]
        padded = torch.cat([x.to(compute), x.new_zeros((pad, heads, dim), dtype=compute)])
        # (tiles, heads, block, dim): the layout batched matmul wants.
        self.tiled = padded.view(self.tiles, block, heads, dim).transpose(1, 2)

    def token_index(self, tile: Tensor) -> tuple[Tensor, Tensor]:
        """Clamped token indices ``(pairs, block)`` of each tile and which of them are real."""
        index = tile[:, None] * self.block + torch.arange(self.block, device=tile.device)
        return index.clamp(max=self.total - 1), index < self.total


def _key_range(q: _Stream, kv_total: int, q_offsets: Tensor, kv_offsets: Tensor, is_self: bool,
               params: AttentionParams, num_targets: Tensor | None
               ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Per query token, the first and last key index (global, inclusive) it may see: a superset
    of its visible keys, used only to choose tiles (the exact mask is applied inside them)."""
    token = torch.arange(q.total, device=q_offsets.device)
    start, end = kv_offsets[:-1][q.sample], kv_offsets[1:][q.sample]
    lo, hi = start.clone(), end - 1
    extra: dict[str, Tensor] = {}
    if is_self:
        pos = token - q_offsets[:-1][q.sample]
        length = q.lengths[q.sample]
        targets = (num_targets.to(length.dtype)[q.sample] if num_targets is not None
                   else torch.zeros_like(length))
        history = length - targets
        extra = {"pos": pos, "length": length, "targets": targets}
        if params.causal:
            sees_all_history = (pos < params.num_prefix) & (pos < history)
            hi = torch.where(sees_all_history, start + history - 1, token)
        if params.window is not None and params.num_prefix == 0 and params.causal:
            lo = torch.maximum(start, start + torch.minimum(pos, history) - params.window)
    empty = hi < lo
    lo = torch.where(empty, torch.full_like(lo, kv_total), lo)
    hi = torch.where(empty, torch.full_like(hi, -1), hi)
    return lo, hi, extra


def _round_units(units: Tensor) -> Tensor:
    """Round key-span lengths (in key blocks) up to a quarter-octave series (1 to 7, then 8, 10,
    12, 14, 16, 20, 24, 28, 32, 40, ...): four widths per octave at any length, each at most
    25 % wider than the span it holds."""
    octave = torch.floor(torch.log2(units.clamp(min=1).double())).to(torch.int64)
    step = (2 ** (octave - 2)).clamp(min=1)
    return (units + step - 1) // step * step


def _span_groups(q: _Stream, kv_total: int, block_k: int, lo: Tensor, hi: Tensor
                 ) -> tuple[Tensor, Tensor, list[tuple[int, Tensor]]]:
    """Per query tile the first and last key it may need, and the tiles grouped by the width of
    that key span (rounded up), as ``(width, tile indices)``; tiles that need no key are left
    out (their output is zero)."""
    pad = q.tiles * q.block - q.total
    first = torch.cat([lo, lo.new_full((pad,), kv_total)]).view(q.tiles, q.block).amin(1)
    last = torch.cat([hi, hi.new_full((pad,), -1)]).view(q.tiles, q.block).amax(1)
    span = last - first + 1
    has_keys = span > 0
    width = torch.where(has_keys, _round_units(-(-span // block_k)) * block_k, 0)
    groups = []
    for value in torch.unique(width[has_keys]).tolist():
        groups.append((int(value), torch.nonzero(width == value).flatten()))
    return first, last, groups


def blocked_attention(
    q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, kv_offsets: Tensor, *,
    params: AttentionParams, num_targets: Tensor | None = None,
    block_q: int | None = None, block_k: int | None = None, bias: RelativeBias | None = None,
) -> Tensor:
    """See :class:`gem_core.contracts.AttentionBackend`; ``block_q`` (query tile) and
    ``block_k`` (granularity of key spans) default to :func:`auto_block` of each side."""
    is_self = checked_inputs("blocked", DTYPES, q, k, v, q_offsets, kv_offsets, params,
                             num_targets, bias)
    if q.shape[0] == 0 or k.shape[0] == 0:
        return q.new_zeros(q.shape)
    # Its own float32 (or float64) math; an enclosing bf16 autocast must not recast it.
    with torch.autocast(device_type=q.device.type, enabled=False):
        return _blocked(q, k, v, q_offsets.to(torch.int64), kv_offsets.to(torch.int64), params,
                        num_targets, is_self, block_q, block_k, bias)


def _plain_causal(params: AttentionParams, is_self: bool, num_targets: Tensor | None) -> bool:
    return (is_self and params.causal and params.window is None and params.num_prefix == 0
            and params.normalization == "softmax"
            and (num_targets is None or not bool(num_targets.any())))


def _causal_by_length(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, scale: float,
                      compute: torch.dtype) -> Tensor:
    """Plain causal softmax: samples grouped by length (rounded up a quarter octave), each
    group padded on the right to its width and run through the fused kernel's ``is_causal``
    path, which skips the tiles above the diagonal and needs no mask tensor. Right padding never
    changes a real row of a causal product."""
    lengths = offsets[1:] - offsets[:-1]
    width = _round_units(lengths)
    flat = [t.to(compute) for t in (q, k, v)]
    heads, dim = q.shape[1:]
    outputs, order = [], []
    for value in torch.unique(width[lengths > 0]).tolist():
        members = torch.nonzero((width == value) & (lengths > 0)).flatten()
        index = offsets[:-1][members][:, None] + torch.arange(value, device=q.device)
        real = index < offsets[1:][members][:, None]
        index = torch.where(real, index, offsets[:-1][members][:, None])
        qg, kg, vg = (_gather(t, index.flatten()).view(members.numel(), value, heads, dim)
                      .transpose(1, 2) for t in flat)
        out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=scale)
        outputs.append(out.transpose(1, 2)[real])
        order.append(index[real])
    result = flat[0].new_zeros(flat[0].shape)
    if outputs:
        result = result.index_copy(0, torch.cat(order), torch.cat(outputs))
    return result.to(q.dtype)


def _blocked(q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, kv_offsets: Tensor,
             params: AttentionParams, num_targets: Tensor | None, is_self: bool,
             block_q: int | None, block_k: int | None,
             bias: RelativeBias | None = None) -> Tensor:
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = params.resolved_scale(q.shape[-1])
    if bias is None and _plain_causal(params, is_self, num_targets):
        return _causal_by_length(q, k, v, q_offsets, scale, compute)
    q_lengths, kv_lengths = q_offsets[1:] - q_offsets[:-1], kv_offsets[1:] - kv_offsets[:-1]
    window = params.window if is_self and params.causal else None
    bq = block_q or auto_block(q.shape[0], int((q_lengths > 0).sum()), window)
    bk = block_k or auto_block(k.shape[0], int((kv_lengths > 0).sum()), window)
    qs = _Stream(q, q_offsets, bq, compute)
    kv_sample = torch.repeat_interleave(torch.arange(kv_lengths.numel(), device=k.device),
                                        kv_lengths)
    lo, hi, extra = _key_range(qs, k.shape[0], q_offsets, kv_offsets, is_self, params,
                               num_targets)
    first, last, groups = _span_groups(qs, k.shape[0], bk, lo, hi)
    keys, values = k.to(compute), v.to(compute)
    heads, dim = q.shape[1:]
    if bias is not None:  # self-attention (validated): the bias position of every token
        bias_pos = bias_positions(extra["pos"], extra["length"], extra["targets"])
    outputs, order = [], []
    for width, tiles in groups:
        qi, q_real = qs.token_index(tiles)
        key_index = first[tiles][:, None] + torch.arange(width, device=k.device)
        k_real = key_index <= last[tiles][:, None]
        key_index = key_index.clamp(max=k.shape[0] - 1)
        mask = ((torch.where(q_real, qs.sample[qi], -1)[:, :, None]
                 == torch.where(k_real, kv_sample[key_index], -2)[:, None, :]))
        if is_self:
            pos = extra["pos"]
            mask = mask & visible(pos[qi][:, :, None], pos[key_index][:, None, :],
                                  extra["length"][qi][:, :, None],
                                  extra["targets"][qi][:, :, None], params)
        flat = key_index.flatten()
        kg = _gather(keys, flat).view(tiles.numel(), width, heads, dim).transpose(1, 2)
        vg = _gather(values, flat).view(tiles.numel(), width, heads, dim).transpose(1, 2)
        qg = _gather(qs.tiled, tiles)
        tile_bias = None
        if bias is not None:
            # (tiles, heads, block_q, width); padding slots index real tokens (clamped) and are
            # masked below.
            tile_bias = relative_bias_values(
                bias, bias_pos[qi][:, :, None], bias_pos[key_index][:, None, :],
                qi[:, :, None], key_index[:, None, :]).transpose(0, 1).to(compute)
        if params.normalization == "softmax":
            # Rows that see nothing (padding, or a sample without keys) are pointed at key 0
            # so the fused kernel stays finite, then zeroed.
            seen = mask.any(-1)
            mask[:, :, 0] |= ~seen
            attn_mask = mask[:, None]
            if tile_bias is not None:  # additive float mask: the bias, -inf where masked
                attn_mask = tile_bias.masked_fill(~attn_mask, float("-inf"))
            out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=attn_mask, scale=scale)
            out = out * seen[:, None, :, None]
        else:
            # A query of a sample without keys sees nothing (mask all False): divide by 1.
            n = kv_lengths.clamp(min=1).to(compute)[qs.sample[qi]]
            scores = torch.matmul(qg, kg.transpose(-1, -2)) * scale
            if tile_bias is not None:
                scores = scores + tile_bias
            out = torch.matmul(F.silu(scores) * mask[:, None] / n[:, None, :, None], vg)
        outputs.append(out)
        order.append(tiles)
    tiled = qs.tiled.new_zeros((qs.tiles, heads, bq, dim))
    if outputs:
        tiled = tiled.index_copy(0, torch.cat(order), torch.cat(outputs))
    return tiled.transpose(1, 2).reshape(qs.tiles * bq, heads, dim)[: q.shape[0]].to(q.dtype)
