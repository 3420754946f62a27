"""The fused gated-norm kernels (interpreted on CPU) equal the PyTorch reference, with gradients."""

import pytest
import torch

from gem_kernels.norms.reference import gated_norm_reference
from gem_kernels.norms.triton_op import gated_norm

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(0, 24), (3, 24), (2, 17, 40)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_reference(kind, dtype, shape, with_bias):
    gen = torch.Generator().manual_seed(0)
    width = shape[-1]

    def leaf(*size, scale=1.0, shift=0.0):
        t = torch.randn(*size, generator=gen, dtype=torch.float64) * scale + shift
        return t.to(dtype).requires_grad_(True)

    x, gate = leaf(*shape, scale=2.0, shift=0.5), leaf(*shape)
    weight, bias = leaf(width, shift=1.0), leaf(width) if with_bias else None
    grad = torch.randn(*shape, generator=gen).to(dtype)
    inputs = [t for t in (x, gate, weight, bias) if t is not None]

    out = gated_norm(x, gate, weight, bias, kind=kind)
    grads = torch.autograd.grad(out, inputs, grad) if out.numel() else None
    as64 = [t.detach().double().requires_grad_(True) for t in inputs]
    ref = gated_norm_reference(*as64[:3], as64[3] if with_bias else None, kind=kind)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    if grads is None:
        return
    ref_grads = torch.autograd.grad(ref, as64, grad.double())
    for got, want in zip(grads, ref_grads):
        scale = max(1.0, float(want.abs().max()))
        torch.testing.assert_close(got.double(), want, atol=tol * scale, rtol=tol)


def test_unknown_kind_is_refused():
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="batch"):
        gated_norm(x, x, torch.ones(16), kind="batch")
