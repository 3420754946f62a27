"""The gated-norm conformance suite: subclass it to prove a norm backend computes the reference.

    from gem_core.testing import NormConformance

    class TestMyNorm(NormConformance):
        dtypes = (torch.float32, torch.bfloat16)

        def make_backend(self):
            return MyNorm()

Hypothesis draws row counts (including 0 and 1), widths (odd ones and ones past a power of two),
both kinds (LayerNorm, RMSNorm), with and without bias, and inputs with a non-zero mean and a
scale far from 1; the backend's output and the gradients of x, gate, weight and bias are compared
with :func:`gem_core.norm.gated_norm_reference` in float64, within one tolerance per dtype.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gem_core.norm import gated_norm_reference
from gem_core.testing.attention_conformance import DEFAULT_TOLERANCES, Tolerance


class NormConformance:
    """Base class of a gated-norm backend's conformance tests. Override :meth:`make_backend`."""

    dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    kinds: tuple[str, ...] = ("layer", "rms")
    max_rows: int = 40
    max_width: int = 130
    max_examples: int = 25
    device: str = "cpu"
    tolerances: dict[torch.dtype, Tolerance] = DEFAULT_TOLERANCES

    def make_backend(self) -> Any:
        """Return the backend under test (see :class:`gem_core.norm.NormBackend`)."""
        raise NotImplementedError("subclasses of NormConformance must override make_backend")

    def _check(self, rows: int, width: int, kind: str, with_bias: bool, dtype: torch.dtype,
               seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)

        def leaf(*size: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
            t = torch.randn(*size, generator=gen, dtype=torch.float64) * scale + shift
            return t.to(dtype).to(self.device).requires_grad_(True)

        x, gate = leaf(rows, width, scale=3.0, shift=0.7), leaf(rows, width)
        weight = leaf(width, scale=0.5, shift=1.0)
        bias = leaf(width) if with_bias else None
        inputs = [t for t in (x, gate, weight, bias) if t is not None]
        grad = torch.randn(rows, width, generator=gen).to(dtype).to(self.device)
        out = self.make_backend().gated_norm(x, gate, weight, bias, kind=kind)
        as64 = [t.detach().cpu().double().requires_grad_(True) for t in inputs]
        want = gated_norm_reference(as64[0], as64[1], as64[2], as64[3] if with_bias else None,
                                    kind=kind)
        case = f"rows={rows} width={width} kind={kind} bias={with_bias} dtype={dtype} seed={seed}"
        assert out.dtype == dtype and out.shape == want.shape, case
        self._close("output", out, want, dtype, case)
        if rows == 0:
            return
        got_grads = torch.autograd.grad(out, inputs, grad)
        want_grads = torch.autograd.grad(want, as64, grad.cpu().double())
        for name, got, ref in zip(("x", "gate", "weight", "bias"), got_grads, want_grads):
            self._close(f"grad of {name}", got, ref, dtype, case)

    def _close(self, name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype,
               case: str) -> None:
        if want.numel() == 0:
            return
        tol = self.tolerances[dtype]
        want = want.detach()
        got64 = got.detach().cpu().double()
        assert torch.isfinite(got64).all(), f"{name} not finite for {case}"
        bound = tol.atol * max(1.0, float(want.abs().max())) + tol.rtol * want.abs()
        worst = float(((got64 - want).abs() - bound).max())
        assert worst <= 0, f"{name} off by {worst:.3g} beyond tolerance for {case}"

    def test_matches_the_reference(self) -> None:
        @settings(max_examples=self.max_examples, deadline=None,
                  suppress_health_check=[HealthCheck.too_slow])
        @given(rows=st.integers(0, self.max_rows), width=st.integers(1, self.max_width),
               kind=st.sampled_from(self.kinds), with_bias=st.booleans(),
               dtype=st.sampled_from(self.dtypes), seed=st.integers(0, 2**16))
        def run(rows, width, kind, with_bias, dtype, seed):
            self._check(rows, width, kind, with_bias, dtype, seed)

        run()

    def test_rejects_an_unknown_kind(self) -> None:
        x = torch.randn(2, 16, device=self.device)
        with pytest.raises(ValueError, match="batch"):
            self.make_backend().gated_norm(x, x, torch.ones(16, device=self.device),
                                           kind="batch")
