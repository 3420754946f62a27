"""The Triton custom op composes with autograd and torch.compile, and refuses CPU tensors loudly
when the kernels are compiled rather than interpreted."""

import os
import subprocess
import sys

import torch

from gem_core.attention.api import AttentionParams
from gem_core.attention.reference import reference_attention
from gem_kernels.attention.triton_backend import TritonAttention
from gem_kernels.attention.triton_op import jagged_attention_fwd


def _inputs():
    gen = torch.Generator().manual_seed(0)
    offsets = torch.tensor([0, 5, 5, 21])
    qkv = [torch.randn(21, 1, 16, generator=gen, requires_grad=True) for _ in range(3)]
    return qkv, offsets


def test_cpu_tensors_without_interpreter_raise_a_clear_error():
    code = (
        "import torch\n"
        "from gem_core.attention.api import AttentionParams\n"
        "from gem_kernels.attention.triton_backend import TritonAttention\n"
        "x = torch.randn(4, 1, 16); o = torch.tensor([0, 4])\n"
        "TritonAttention()(x, x, x, o, o, params=AttentionParams())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode != 0
    assert "TRITON_INTERPRET=1" in out.stderr and "CPU" in out.stderr


def test_torch_compile_traces_the_custom_op_with_backward():
    (q, k, v), offsets = _inputs()
    nt = torch.zeros(3, dtype=torch.int64)
    # Positional scalars: is_self, causal, window, prefix, silu, scale, max_q, max_kv, blocks.
    options = (True, True, 4, 1, False, 0.25, 16, 16, 16, 16)

    def loss(q, k, v):
        out, _ = jagged_attention_fwd(q, k, v, offsets, offsets, nt, *options)
        return out.square().sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    grads = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    params = AttentionParams(causal=True, window=4, num_prefix=1, scale=0.25)
    ref = reference_attention(q, k, v, offsets, offsets, params=params).square().sum()
    ref_grads = torch.autograd.grad(ref, (q, k, v))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_opcheck_passes():
    (q, k, v), offsets = _inputs()
    nt = torch.zeros(3, dtype=torch.int64)
    args = (q, k, v, offsets, offsets, nt, True, False, -1, 0, True, 0.25, 16, 16, 16, 16)
    torch.library.opcheck(torch.ops.gem_kernels.jagged_attention_fwd.default, args)


def test_block_sizes_are_checked():
    for bad in (8, 48):
        try:
            TritonAttention(block_m=bad)
        except ValueError as error:
            assert "block_m" in str(error)
        else:
            raise AssertionError(f"block_m={bad} was accepted")


def test_kernels_compile_for_an_h200_without_a_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-m", "gem_kernels.triton_aot_check", "--capability", "90"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("shared memory") == 3


def test_backward_writes_every_gradient_row(monkeypatch):
    """The backward allocates dq/dk/dv without a memset: poisoning fresh buffers with NaN shows
    that the kernels store every row, including rows of samples with no keys or no queries."""
    real_empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like",
                        lambda t, **kw: real_empty_like(t, **kw).fill_(float("nan")))
    gen = torch.Generator().manual_seed(1)
    q_offsets = torch.tensor([0, 5, 5, 9, 30])
    kv_offsets = torch.tensor([0, 7, 9, 9, 25])
    q = torch.randn(30, 2, 16, generator=gen, requires_grad=True)
    k, v = (torch.randn(25, 2, 16, generator=gen, requires_grad=True) for _ in range(2))
    params = AttentionParams()
    grad = torch.randn(30, 2, 16, generator=gen)
    got = torch.autograd.grad(TritonAttention(16, 16)(q, k, v, q_offsets, kv_offsets,
                                                       params=params), (q, k, v), grad)
    monkeypatch.undo()
    want = torch.autograd.grad(reference_attention(q, k, v, q_offsets, kv_offsets,
                                                   params=params), (q, k, v), grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
