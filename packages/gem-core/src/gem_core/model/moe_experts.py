"""The experts of a mixture: ``E`` MLPs of one kind with their weights stacked, ``(E, in, out)``.

Stacked weights serve both execution paths with one state dict: ``one(e, x)`` runs expert ``e``
alone (the reference path runs them one after another), ``grouped(x, counts)`` runs every expert
over its contiguous slice of expert-sorted rows with batched matmuls: ``torch._grouped_mm``
where it runs on the device and dtype, else a bmm over rows padded to the largest group.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gem_core.jagged import max_length

log = logging.getLogger(__name__)

KINDS = ("swiglu", "mlp")


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: ``_grouped_mm``'s CPU
    backward rejects the stride-0 gradients that ``sum()`` and ``expand`` produce."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of ``torch._grouped_mm`` for FlopCounterMode (which has no formula for it)."""
    if len(a_shape) == 2 and len(b_shape) == 3:  # rows (M, K), one (K, N) per group
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 2:  # (K, M) x (M, N), M split in groups
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    if len(a_shape) == 3 and len(b_shape) == 3:  # batched (G, M, K) x (G, K, N)
        return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]
    return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[-1]  # (G, M, K) x (K_total, N)


def _register_grouped_mm_flops() -> None:
    """MFU accounting and ``gem bench flops`` count matmuls with FlopCounterMode; without a
    formula the grouped path's expert matmuls would count as zero. Only a count, registered
    once unless torch has its own."""
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    target = getattr(torch.ops.aten, "_grouped_mm", None)
    if target is not None and target not in flop_registry:
        register_flop_formula(target)(_grouped_mm_flops)


_register_grouped_mm_flops()


def _keep(tensor: Tensor) -> Tensor:
    return tensor


def _uniform(shape: tuple[int, ...], fan_in: int) -> nn.Parameter:
    bound = 1 / math.sqrt(fan_in)  # nn.Linear's default, per expert
    return nn.Parameter(torch.empty(shape).uniform_(-bound, bound))


class ExpertMLPs(nn.Module):
    """``num_experts`` MLPs ``in_dim -> hidden -> out_dim``.

    ``swiglu``: ``down(silu(gate) * up)`` without biases (the sequence layers' MLP; weights
    ``gate``, ``up`` ``(E, in, hidden)`` and ``down`` ``(E, hidden, out)``).
    ``mlp``: ``Linear -> SiLU -> Linear`` with biases (the Wukong factorization-machine MLP).
    """

    def __init__(self, kind: str, num_experts: int, in_dim: int, hidden: int,
                 out_dim: int) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"expert kind must be one of {', '.join(KINDS)}; got {kind!r}")
        self.kind, self.num_experts = kind, num_experts
        self.in_dim, self.hidden, self.out_dim = in_dim, hidden, out_dim
        if kind == "swiglu":
            # Gate and up as separate stacks: the grouped path's elementwise work then runs on
            # contiguous (rows, hidden) products, not on strided halves of one.
            self.gate = _uniform((num_experts, in_dim, hidden), in_dim)
            self.up = _uniform((num_experts, in_dim, hidden), in_dim)
            self.down = _uniform((num_experts, hidden, out_dim), hidden)
        else:
            self.w_in = _uniform((num_experts, in_dim, hidden), in_dim)
            self.b_in = _uniform((num_experts, hidden), in_dim)
            self.w_out = _uniform((num_experts, hidden, out_dim), hidden)
            self.b_out = _uniform((num_experts, out_dim), hidden)
        self._grouped_mm_ok: dict[tuple[str, torch.dtype], bool] = {}
        self.last_grouped_backend = ""
        """``grouped_mm`` or ``padded_bmm``: what the last ``grouped`` call used."""

    @property
    def local_experts(self) -> int:
        """Experts whose weights this module holds (fewer than ``num_experts`` once an
        expert-parallel strategy keeps only a rank's share)."""
        first = self.gate if self.kind == "swiglu" else self.w_in
        return first.shape[0]

    def flops_per_row(self) -> int:
        """Forward matmul FLOPs of one expert on one row."""
        width = 2 * self.hidden if self.kind == "swiglu" else self.hidden
        return 2 * self.in_dim * width + 2 * self.hidden * self.out_dim

    # -- one expert ---------------------------------------------------------------------------

    def one(self, e: int, x: Tensor) -> Tensor:
        if self.kind == "swiglu":
            return (F.silu(x @ self.gate[e]) * (x @ self.up[e])) @ self.down[e]
        hidden = F.silu(x @ self.w_in[e] + self.b_in[e])
        return hidden @ self.w_out[e] + self.b_out[e]

    def sequential(self, x: Tensor, counts: Tensor) -> Tensor:
        """Expert-sorted rows (``counts[e]`` rows for local expert e, in order), one expert
        after another."""
        outputs, start = [], 0
        for e, count in enumerate(counts.tolist()):
            if count:
                outputs.append(self.one(e, x[start:start + count]))
            start += count
        if not outputs:
            # No rows: still an output on the autograd graph of x and the weights, so that a
            # backward that must pass through here (expert parallelism's all-to-all) does.
            return self.one(0, x[:0])
        return torch.cat(outputs)

    # -- all experts batched --------------------------------------------------------------------

    def grouped(self, x: Tensor, counts: Tensor) -> Tensor:
        """Expert-sorted rows, every expert's matmul in one batched call per layer."""
        device = x.device.type
        # torch._grouped_mm is not an autocast op: cast to the autocast dtype by hand, as
        # autocast does for the reference path's matmuls.
        dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                 else x.dtype)
        if self._grouped_mm_works(x.device, dtype):
            self.last_grouped_backend = "grouped_mm"
            offsets = torch.cumsum(counts, 0).to(torch.int32)
            return self._run(x, lambda rows, w: _ContiguousGrad.apply(
                torch._grouped_mm(rows.to(dtype).contiguous(), w.to(dtype).contiguous(),
                                  offs=offsets)),
                counts)
        self.last_grouped_backend = "padded_bmm"
        return self._padded_bmm(x, counts)

    def _run(self, x: Tensor, matmul, counts: Tensor) -> Tensor:
        if self.kind == "swiglu":
            return matmul(F.silu(matmul(x, self.gate)) * matmul(x, self.up), self.down)
        expert_of_row = torch.repeat_interleave(
            torch.arange(counts.numel(), device=x.device), counts, output_size=x.shape[0])
        hidden = F.silu(matmul(x, self.w_in) + self.b_in[expert_of_row])
        return matmul(hidden, self.w_out) + self.b_out[expert_of_row]

    def _padded_bmm(self, x: Tensor, counts: Tensor) -> Tensor:
        experts = counts.numel()
        capacity = max_length(counts)
        expert_of_row = torch.repeat_interleave(
            torch.arange(experts, device=x.device), counts, output_size=x.shape[0])
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(x.shape[0], device=x.device) - starts[expert_of_row]

        def matmul(rows: Tensor, w: Tensor) -> Tensor:
            padded = rows.new_zeros(experts, capacity, rows.shape[-1])
            padded = padded.index_put((expert_of_row, slot), rows)
            return torch.bmm(padded, w)[expert_of_row, slot]

        return self._run(x, matmul, counts)

    def _grouped_mm_works(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether ``torch._grouped_mm`` runs forward and backward for this device and dtype
        (probed once on a small problem; it has no float64 kernel, for one) and these widths
        (its rows must be 16-byte aligned)."""
        widths = (self.in_dim, self.hidden, self.out_dim)
        if any(width * dtype.itemsize % 16 for width in widths):
            return False
        if torch.compiler.is_compiling():
            # A captured graph (torch.export) takes the padded bmm: torch._grouped_mm's meta
            # kernel accepts bfloat16 only, and the probe must not run inside a capture.
            return False
        key = (device.type, dtype)
        if key not in self._grouped_mm_ok:
            ok = hasattr(torch, "_grouped_mm")
            if ok:
                try:
                    # Evaluation runs under no_grad: the probe needs a backward. Its own
                    # saved-tensor hooks keep it out of an enclosing activation checkpoint's
                    # count (the recomputation does not probe again).
                    with torch.inference_mode(False), torch.enable_grad(), \
                            torch.autocast(device.type, enabled=False), \
                            torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
                        self._probe_grouped_mm(device, dtype)
                except RuntimeError as error:
                    log.info("torch._grouped_mm unavailable for %s %s (%s); experts use a padded "
                             "bmm", key[0], key[1], str(error).splitlines()[0])
                    ok = False
            self._grouped_mm_ok[key] = ok
        return self._grouped_mm_ok[key]

    @staticmethod
    def _probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> None:
        # Deterministic inputs: the probe must not draw from the global RNG (it runs inside the
        # first forward, and a draw there would shift data order and dropout).
        a = torch.linspace(-1, 1, 64, device=device, dtype=dtype).view(4, 16)
        w = torch.linspace(-1, 1, 512, device=device, dtype=dtype).view(2, 16, 16)
        a.requires_grad_(True)
        w.requires_grad_(True)
        offs = torch.tensor([1, 4], device=device, dtype=torch.int32)
        torch._grouped_mm(a, w, offs=offs).square().sum().backward()
