"""How the attention conformance suite runs one case and compares it: the backend and the
float64 reference (or, given a relative bias, the padded oracle of
:mod:`gem_core.testing.attention_oracle`) on the same rounded inputs, outputs and gradients
within the dtype's tolerance. :meth:`AttentionCaseChecks.check_case` also serves scripts
without pytest or hypothesis (``python -m gem_kernels.bench.gpu_check``). The tests that draw
and choose the cases are :class:`gem_core.testing.AttentionConformance`."""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch
from torch import Tensor

from gem_core.attention.reference import reference_attention
from gem_core.attention.relative_bias import RelativeBias
from gem_core.capabilities import RELATIVE_BIAS
from gem_core.jagged import offsets_from_lengths
from gem_core.testing.attention_drawing import AttentionCaseDrawing
from gem_core.testing.attention_oracle import (
    DEFAULT_TOLERANCES,
    AttentionCase,
    Tolerance,
    _close,
    padded_biased_attention,
)


class AttentionCaseChecks(AttentionCaseDrawing):
    """What the backend under test is and declares, and the comparison of one case with the
    reference. Class attributes are overridden in a backend's test class (see
    :class:`gem_core.testing.AttentionConformance`)."""

    registered_as: ClassVar[str | None] = None
    """The backend's registered name: its registration's declared ``capabilities`` decide
    whether the relative-bias tests run, and its declared normalisations must be exactly
    :attr:`normalizations`. None (a backend not registered): :attr:`capabilities` instead."""

    capabilities: ClassVar[frozenset[str]] = frozenset()
    """What an unregistered backend declares (with :attr:`registered_as` None)."""

    device: ClassVar[str] = "cpu"
    supports_backward: ClassVar[bool] = True
    tolerances: ClassVar[dict[torch.dtype, Tolerance]] = DEFAULT_TOLERANCES

    def make_backend(self) -> Any:
        """Return the backend under test (see :class:`gem_core.contracts.AttentionBackend`)."""
        raise NotImplementedError("subclasses of AttentionConformance must override make_backend")

    # ----------------------------------------------------------------------------------------
    # Running and comparing one case.
    # ----------------------------------------------------------------------------------------

    def _inputs(self, case: AttentionCase) -> dict[str, Tensor]:
        gen = torch.Generator().manual_seed(case.seed)
        total_q, total_kv = sum(case.q_lengths), sum(case.kv_lengths)
        width = (case.heads, case.head_dim)
        # randn is never all zeros, so a backend that ignores its inputs cannot pass.
        tensors = {
            "q": torch.randn(total_q, *width, generator=gen, dtype=torch.float64),
            "k": torch.randn(total_kv, *width, generator=gen, dtype=torch.float64),
            "v": torch.randn(total_kv, *width, generator=gen, dtype=torch.float64),
            "grad_out": torch.randn(total_q, *width, generator=gen, dtype=torch.float64),
        }
        # Round once to the tested dtype so the float64 reference sees exactly the same values.
        return {name: t.to(case.dtype).to(self.device) for name, t in tensors.items()}

    def _offsets(self, case: AttentionCase) -> tuple[Tensor, Tensor, Tensor | None]:
        q_offsets = offsets_from_lengths(torch.tensor(case.q_lengths, dtype=torch.int64))
        kv_offsets = (
            q_offsets if case.shape == "self"
            else offsets_from_lengths(torch.tensor(case.kv_lengths, dtype=torch.int64))
        )
        targets = (
            torch.tensor(case.num_targets, dtype=torch.int64) if case.num_targets is not None
            else None
        )
        move = lambda t: None if t is None else t.to(self.device)  # noqa: E731
        return move(q_offsets), move(kv_offsets), move(targets)

    @staticmethod
    def _forward_backward(
        backend: Any, inputs: dict[str, Tensor], offsets: tuple, case: AttentionCase,
        dtype: torch.dtype, backward: bool,
    ) -> tuple[Tensor, list[Tensor] | None]:
        q, k, v = (inputs[n].to(dtype).detach().requires_grad_(backward) for n in ("q", "k", "v"))
        q_offsets, kv_offsets, num_targets = offsets
        out = backend(
            q, k, v, q_offsets, kv_offsets, params=case.params, num_targets=num_targets,
            max_q_len=max(case.q_lengths, default=0), max_kv_len=max(case.kv_lengths, default=0),
        )
        if not backward:
            return out, None
        if not out.requires_grad:  # nothing attends to anything (every sample is empty)
            return out, [torch.zeros_like(t) for t in (q, k, v)]
        loss = (out.to(dtype) * inputs["grad_out"].to(dtype)).sum()
        grads = torch.autograd.grad(loss, (q, k, v), allow_unused=True)
        return out, [torch.zeros_like(t) if g is None else g for t, g in zip((q, k, v), grads)]

    def check_case(self, case: AttentionCase) -> None:
        """Compare the backend with the float64 reference on ``case``; raise AssertionError."""
        if case.bias is not None:
            self.check_bias_case(case)
            return
        backend = self.make_backend()
        inputs = self._inputs(case)
        offsets = self._offsets(case)
        backward = self.supports_backward
        out, grads = self._forward_backward(backend, inputs, offsets, case, case.dtype, backward)
        assert out.dtype == case.dtype, f"output dtype {out.dtype} != input dtype {case.dtype}"
        assert out.device.type == torch.device(self.device).type, f"output on {out.device}"
        ref_out, ref_grads = self._forward_backward(
            reference_attention, inputs, offsets, case, torch.float64, backward
        )
        tol = self.tolerances[case.dtype]
        _close("output", out, ref_out, tol, case)
        if backward:
            for name, got, want in zip(("grad q", "grad k", "grad v"), grads, ref_grads):
                _close(name, got, want, tol, case)

    # ----------------------------------------------------------------------------------------
    # The relative bias.
    # ----------------------------------------------------------------------------------------

    bias_weight_dtype: ClassVar[torch.dtype] = torch.float32
    """The dtype of the bias weight tables handed to the backend (parameters stay fp32)."""

    def declared_capabilities(self) -> frozenset[str]:
        """The registration's ``capabilities`` (or :attr:`capabilities` when unregistered)."""
        if self.registered_as is None:
            return self.capabilities
        return _registered_attention_capabilities(self.registered_as)

    def declares_relative_bias(self) -> bool:
        return RELATIVE_BIAS in self.declared_capabilities()

    def _bias_tensors(self, case: AttentionCase) -> dict[str, Tensor | None]:
        """Weights (std 0.5, rounded once to :attr:`bias_weight_dtype`) and timestamps."""
        spec = case.bias
        gen = torch.Generator().manual_seed(case.seed + 1)
        weights = lambda n: (torch.randn(case.heads, n, generator=gen, dtype=torch.float64)  # noqa: E731
                             * 0.5).to(self.bias_weight_dtype)
        position = weights(spec.num_position_buckets)
        time = weights(spec.num_time_buckets) if spec.num_time_buckets else None
        timestamps = (torch.randint(0, spec.max_timestamp + 1, (sum(case.q_lengths),),
                                    generator=gen, dtype=torch.int64)
                      if spec.num_time_buckets else None)
        return {"position_weights": position, "time_weights": time, "timestamps": timestamps}

    def check_bias_case(self, case: AttentionCase) -> None:
        """Compare the backend given a relative bias with :func:`padded_biased_attention` in
        float64: the output and the gradients of q, k, v and both weight tables."""
        assert case.bias is not None and case.shape == "self", "bias cases are self-attention"
        backend = self.make_backend()
        inputs = self._inputs(case)
        tables = self._bias_tensors(case)
        q_offsets, _, num_targets = self._offsets(case)
        backward = self.supports_backward
        names = ["q", "k", "v", "position_weights"] + (
            ["time_weights"] if tables["time_weights"] is not None else [])

        def run(fn, dtype: torch.dtype, weight_dtype: torch.dtype, device: str
                ) -> tuple[Tensor, list[Tensor]]:
            leaves = {n: inputs[n].to(device, dtype).detach().requires_grad_(backward)
                      for n in ("q", "k", "v")}
            for n in ("position_weights", "time_weights"):
                if tables[n] is not None:
                    leaves[n] = (tables[n].to(device, weight_dtype).detach()
                                 .requires_grad_(backward))
            timestamps = (tables["timestamps"].to(device) if tables["timestamps"] is not None
                          else None)
            out = fn(leaves, timestamps)
            if not backward:
                return out, []
            wanted = [leaves[n] for n in names]
            if not out.requires_grad:
                return out, [torch.zeros_like(t) for t in wanted]
            loss = (out.to(dtype) * inputs["grad_out"].to(device, dtype)).sum()
            grads = torch.autograd.grad(loss, wanted, allow_unused=True)
            return out, [torch.zeros_like(t) if g is None else g for t, g in zip(wanted, grads)]

        def backend_call(leaves: dict[str, Tensor], timestamps: Tensor | None) -> Tensor:
            bias = RelativeBias(position_weights=leaves["position_weights"],
                                time_weights=leaves.get("time_weights"), timestamps=timestamps,
                                time_bucket_divisor=case.bias.time_bucket_divisor)
            return backend(leaves["q"], leaves["k"], leaves["v"], q_offsets, q_offsets,
                           params=case.params, num_targets=num_targets,
                           max_q_len=max(case.q_lengths, default=0),
                           max_kv_len=max(case.kv_lengths, default=0), bias=bias)

        lengths = torch.tensor(case.q_lengths, dtype=torch.int64)
        targets = (torch.tensor(case.num_targets, dtype=torch.int64)
                   if case.num_targets is not None else None)

        def oracle_call(leaves: dict[str, Tensor], timestamps: Tensor | None) -> Tensor:
            return padded_biased_attention(
                leaves["q"], leaves["k"], leaves["v"], lengths, targets, case.params,
                leaves["position_weights"], leaves.get("time_weights"), timestamps,
                case.bias.time_bucket_divisor)

        out, grads = run(backend_call, case.dtype, self.bias_weight_dtype, self.device)
        assert out.dtype == case.dtype, f"output dtype {out.dtype} != input dtype {case.dtype}"
        ref_out, ref_grads = run(oracle_call, torch.float64, torch.float64, "cpu")
        tol = self.tolerances[case.dtype]
        _close("output (relative bias)", out, ref_out, tol, case)
        # A fused softmax backward takes delta_i = sum(dO_i * O_i) from the stored (rounded)
        # output; its error shifts dS_ij by P_ij * error_i, which cancels within a row for q and
        # k but adds up over rows in a weight's gradient (a single bucket's true gradient is 0).
        # So a weight's bound grows by the measured sum over rows of |error_i| (each row's
        # probabilities sum to at most 1 within a bucket).
        slack = None
        if case.params.normalization == "softmax":
            moved = (out.detach().to("cpu", torch.float64) - ref_out.detach()) * inputs[
                "grad_out"].to("cpu", torch.float64)
            slack = moved.sum(-1).abs().sum(0)[:, None]  # (heads, 1)
        for name, got, want in zip(names, grads, ref_grads):
            _close(f"grad {name} (relative bias)", got, want, tol, case,
                   slack if name.endswith("weights") else None)


@functools.lru_cache(maxsize=None)
def _registered_attention_capabilities(name: str) -> frozenset[str]:
    from gem_core.plugins import build_plugins

    return build_plugins().registry("attention").get(name).capabilities
