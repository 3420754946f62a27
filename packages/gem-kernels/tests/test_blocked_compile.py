"""``blocked`` under ``torch.compile``: its custom op gives the eager backend's outputs and
gradients for every option, passes torch.library's op checks, the sequence tower traces with it
in one graph, a compiled GEM model trains like the eager one, and ``auto`` picks it for a compiled
CPU run. Inductor's cache is the repository's ``.cache/inductor`` so reruns skip code generation."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from gem_core.attention import AttentionParams
from gem_core.attention.relative_bias import RelativeBias
from gem_core.capabilities import TORCH_COMPILE
from gem_core.compile import CompileTracker, compile_module, use_inductor_cache
from gem_core.config import ModelConfig
from gem_core.embedding import ReferenceEmbeddingBackend
from gem_core.jagged import offsets_from_lengths
from gem_core.model import build_model
from gem_core.model.sequence_tower import SequenceTower
from gem_core.plugins import build_plugins
from gem_core.registry import AutoContext
from gem_core.testing.models import synthetic_batch
from gem_core.train.loss import mean_loss
from gem_kernels.attention.blocked_backend import BlockedAttention, blocked_attention
from gem_kernels.attention.blocked_op import blocked_attention_op

CACHE = Path(__file__).resolve().parents[3] / ".cache" / "inductor"
LENGTHS = torch.tensor([5, 0, 9, 3, 12])
OFFSETS = offsets_from_lengths(LENGTHS)
TARGETS = torch.tensor([1, 0, 2, 0, 3])


def _bias(with_time: bool) -> RelativeBias:
    generator = torch.Generator().manual_seed(1)
    weights = torch.randn(2, 6, dtype=torch.float64, generator=generator).requires_grad_()
    if not with_time:
        return RelativeBias(position_weights=weights)
    return RelativeBias(
        position_weights=weights,
        time_weights=torch.randn(2, 5, dtype=torch.float64, generator=generator).requires_grad_(),
        timestamps=torch.randint(0, 10_000, (int(LENGTHS.sum()),), generator=generator))


# Every option the backend has: plain causal (its is_causal path), window, prefix, targets,
# SiLU, relative bias with and without time weights, small tiles, cross-attention and PMA.
CASES = {
    "causal": dict(params=AttentionParams(causal=True)),
    "window-targets-silu": dict(params=AttentionParams(causal=True, window=3,
                                                       normalization="silu"),
                                num_targets=TARGETS),
    "prefix-targets-time-bias": dict(params=AttentionParams(causal=True, num_prefix=2),
                                     num_targets=TARGETS, bias=_bias(with_time=True)),
    "bidirectional-silu-position-bias-small-tiles": dict(
        params=AttentionParams(normalization="silu", scale=0.5), bias=_bias(with_time=False),
        block_q=4, block_k=2),
    "cross-attention": dict(params=AttentionParams(), kv_lengths=[3, 2, 4, 1, 7]),
    "pma": dict(params=AttentionParams(normalization="silu"), q_lengths=[2, 2, 2, 2, 2]),
}


@pytest.mark.parametrize("name", CASES)
def test_custom_op_gives_the_eager_outputs_and_gradients(name):
    case = dict(CASES[name])
    q_lengths = torch.tensor(case.pop("q_lengths", LENGTHS.tolist()))
    kv_lengths = torch.tensor(case.pop("kv_lengths", LENGTHS.tolist()))
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(int(q_lengths.sum()), 2, 8, dtype=torch.float64, generator=generator)
    k, v = (torch.randn(int(kv_lengths.sum()), 2, 8, dtype=torch.float64, generator=generator)
            for _ in range(2))
    bias = case.get("bias")
    weights = [] if bias is None else [w for w in (bias.position_weights, bias.time_weights)
                                       if w is not None]
    leaves = [t.requires_grad_() for t in (q, k, v)] + weights
    q_offsets, kv_offsets = offsets_from_lengths(q_lengths), offsets_from_lengths(kv_lengths)
    results = []
    for attend in (blocked_attention, blocked_attention_op):
        out = attend(q, k, v, q_offsets, kv_offsets, **case)
        # A weighted sum, so every output element gets its own gradient.
        weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
        results.append((out, torch.autograd.grad((out * weight).sum(), leaves)))
    (eager, eager_grads), (op, op_grads) = results
    assert eager.abs().sum() > 0
    torch.testing.assert_close(op, eager)
    for got, want in zip(op_grads, eager_grads):
        assert want.abs().sum() > 0
        torch.testing.assert_close(got, want)


def test_custom_op_passes_torch_library_checks():
    """Schema, fake implementation, autograd registration and AOT dispatch with dynamic shapes."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(int(LENGTHS.sum()), 2, 8, generator=generator).requires_grad_()
               for _ in range(3))
    bias = [torch.randn(2, n, generator=generator).requires_grad_() for n in (6, 5)]
    timestamps = torch.randint(0, 10_000, (q.shape[0],), generator=generator)
    torch.library.opcheck(
        torch.ops.gem_kernels.blocked_attention_fwd.default,
        (q, k, v, OFFSETS, OFFSETS, TARGETS, *bias, timestamps, True, 3, 1, False, 0.35, 0, 0,
         0.301))


def test_sequence_tower_traces_without_graph_break():
    params = AttentionParams(causal=True, window=4)
    torch.manual_seed(0)
    x = torch.randn(int(LENGTHS.sum()), 16)
    tower = SequenceTower(16, 2, 2, 32, params, BlockedAttention())
    explained = torch._dynamo.explain(tower)(x, OFFSETS, int(LENGTHS.max()))
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_auto_picks_blocked_for_a_compiled_cpu_run():
    plugins = build_plugins()
    chosen = plugins.resolve("attention", "auto", AutoContext(device="cpu", compile=True))
    assert chosen.spec.name == "blocked" and TORCH_COMPILE in chosen.spec.capabilities


@pytest.mark.slow
def test_compiled_model_trains_like_eager():
    """The sequence blocks of a GEM model (windowed SiLU attention) compiled with blocked against
    the same model eager: three AdamW steps on batches of different token counts give the same
    losses, and the blocks compile once for all of them. (Not with ``model.relative_bias``: the
    block builds its frozen attrs ``RelativeBias`` inside the traced forward, which dynamo cannot
    trace, whatever the backend; the op itself takes the bias, tested above.)"""
    use_inductor_cache(CACHE)
    batches = [synthetic_batch(rows, max_seq_len=24, seed=seed) for rows, seed in
               ((6, 0), (5, 1), (7, 2))]
    schema = batches[0][0]
    assert len({int(batch.num_events) for _, batch in batches}) == 3
    torch.manual_seed(0)
    eager = build_model(ModelConfig(embedding_dim=16, num_heads=2, num_layers=1,
                                    normalization="silu", window=8,
                                    interaction_dims=[16]),
                        schema, attention=BlockedAttention(),
                        embedding_backend=ReferenceEmbeddingBackend())
    compiled = copy.deepcopy(eager)
    for unit in compiled.parallel_units():
        compile_module(unit)
    losses = {"eager": [], "compiled": []}
    with CompileTracker() as tracker:
        for name, model in (("eager", eager), ("compiled", compiled)):
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            for _, batch in batches:
                loss = mean_loss(model(batch), batch, schema.tasks)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses[name].append(float(loss.detach()))
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-5)
    assert losses["eager"][0] != losses["eager"][-1]  # the steps really trained
    # One graph for the first batch, at most one more once max_len turns dynamic.
    assert 1 <= tracker.frames <= 2
