"""The fused gated-norm kernels (interpreted on CPU) pass the norm conformance suite, with
gradients, through the registered ``triton`` norm backend."""

import torch

from gem_core.testing import NormConformance
from gem_kernels.norms.backend import TritonNorm


class TestTritonNormConformance(NormConformance):
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    max_rows = 20
    max_width = 70
    max_examples = 12

    def make_backend(self):
        return TritonNorm()


def test_compiled_and_eager_paths_agree():
    """Eager calls run the kernels through an autograd Function, ``torch.compile`` through the
    custom op: the two give the same outputs and gradients."""
    from gem_kernels.norms.triton_op import gated_norm

    gen = torch.Generator().manual_seed(0)
    leaves = [torch.randn(*shape, generator=gen, requires_grad=True)
              for shape in ((2, 5, 24), (2, 5, 24), (24,), (24,))]
    grad = torch.randn(2, 5, 24, generator=gen)

    def run(fn):
        out = fn(*leaves)
        return [out, *torch.autograd.grad(out, leaves, grad)]

    eager = run(lambda *t: gated_norm(*t, kind="layer"))
    compiled = run(torch.compile(lambda *t: gated_norm(*t, kind="layer"), backend="aot_eager",
                                 fullgraph=True))
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
