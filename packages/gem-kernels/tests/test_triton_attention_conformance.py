"""The Triton backend's real kernels, run by the interpreter on CPU, pass the conformance suite."""

import torch

from gem_core.attention.api import AttentionParams
from gem_core.attention.reference import reference_attention
from gem_core.attention.relative_bias import RelativeBias
from gem_core.testing import AttentionConformance
from gem_kernels.attention.triton_backend import TritonAttention
from gem_kernels.attention.triton_op import jagged_attention_fwd

# The interpreter runs every program in numpy: blocks of 32 keep it near one second per case while
# drawn lengths (up to 2 blocks + 1) still cross block boundaries.
BLOCK = 32


class TestTritonConformance(AttentionConformance):
    registered_as = "triton"
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    block_size = BLOCK
    max_tokens = 140
    max_batch = 3
    max_examples = 20
    bias_max_examples = 10

    def make_backend(self):
        return TritonAttention(block_m=BLOCK, block_n=BLOCK)


class TestTritonConformanceUnevenBlocks(AttentionConformance):
    """Query and key tiles of different sizes exercise the range arithmetic independently."""

    registered_as = "triton"

    dtypes = (torch.float32,)
    block_size = 16
    max_tokens = 80
    max_batch = 2
    # The interpreter's cost is one program per (query tile, sequence, head): heads only repeat
    # the range arithmetic tested here (TestTritonConformance draws 2).
    max_heads = 1
    max_examples = 5

    def make_backend(self):
        return TritonAttention(block_m=16, block_n=32)


def _bias_inputs():
    gen = torch.Generator().manual_seed(2)
    offsets = torch.tensor([0, 5, 5, 21])
    q, k, v = (torch.randn(21, 2, 16, generator=gen, requires_grad=True) for _ in range(3))
    position = (0.5 * torch.randn(2, 6, generator=gen)).requires_grad_()
    time = (0.5 * torch.randn(2, 9, generator=gen)).requires_grad_()
    timestamps = torch.randint(0, 3000, (21,), generator=gen)
    return (q, k, v), offsets, position, time, timestamps


def test_torch_compile_traces_the_custom_op_with_a_relative_bias():
    """The custom op takes the bias table and timestamps as trailing arguments and returns the
    table's gradient; fullgraph compile with backward matches the reference."""
    (q, k, v), offsets, position, time, timestamps = _bias_inputs()
    nt = torch.tensor([1, 0, 2])
    # Positional scalars: is_self, causal, window, prefix, silu, scale, max_q, max_kv, blocks.
    options = (True, True, 6, 1, False, 0.25, 16, 16, 16, 16)

    def loss(q, k, v, position, time):
        table = torch.cat([position, time], dim=1)
        out, _ = jagged_attention_fwd(q, k, v, offsets, offsets, nt, *options, table, timestamps,
                                      position.shape[1], 0.5)
        return out.square().sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    leaves = (q, k, v, position, time)
    grads = torch.autograd.grad(compiled(*leaves), leaves)
    params = AttentionParams(causal=True, window=6, num_prefix=1, scale=0.25)
    bias = RelativeBias(position_weights=position, time_weights=time, timestamps=timestamps,
                        time_bucket_divisor=0.5)
    ref = reference_attention(q, k, v, offsets, offsets, params=params, num_targets=nt,
                              bias=bias).square().sum()
    for got, want in zip(grads, torch.autograd.grad(ref, leaves)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_opcheck_passes_with_a_relative_bias():
    (q, k, v), offsets, position, time, timestamps = _bias_inputs()
    nt = torch.zeros(3, dtype=torch.int64)
    table = torch.cat([position, time], dim=1).detach().requires_grad_()
    args = (q, k, v, offsets, offsets, nt, True, False, -1, 0, True, 0.25, 16, 16, 16, 16,
            table, timestamps, position.shape[1], 0.301)
    torch.library.opcheck(torch.ops.gem_kernels.jagged_attention_fwd.default, args)
