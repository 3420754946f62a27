"""A routed mixture of expert MLPs that stands in for one MLP (Shazeer et al. 2017; GShard;
Switch Transformer): a float32 top-k router (see ``moe_router``), ``E`` experts of the replaced
MLP's kind and size (see ``moe_experts``), an optional shared expert every token goes through,
a capacity per expert, and the auxiliary load-balancing loss.

Execution paths (``impl``), equal in outputs and gradients:

- ``reference``: for each expert in turn, pick its tokens, run it, add its gated output back;
- ``grouped``: sort the kept assignments by expert once, run all experts with batched matmuls,
  scatter back once.

Expert parallelism never enters this file: a strategy sets ``dispatcher`` to an object with
``run(rows, counts, experts, impl) -> rows`` that sends expert-sorted rows to the ranks owning
their experts and brings the outputs back in the same order (gem-parallel's ``ep``).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor, nn

from gem_core.config import MoeConfig
from gem_core.flops import linear_layer_flops
from gem_core.model.last_forward import LastForward
from gem_core.model.moe_experts import ExpertMLPs
from gem_core.model.moe_router import Routing, TopKRouter, load_balancing_loss

IMPLS = ("reference", "grouped")


class Dispatcher(Protocol):
    def run(self, rows: Tensor, counts: Tensor, experts: ExpertMLPs, impl: str) -> Tensor:
        """Expert outputs for ``rows`` sorted by global expert (``counts[e]`` rows each)."""


def moe_last_forward() -> LastForward:
    """What an MoE layer's training forward leaves: its weighted load-balancing loss and its
    routing counts (``last_aux_loss``, ``last_stats``); shared by every MoE implementation."""
    return LastForward(aux_loss=None, stats={})


class MixtureOfExperts(nn.Module):
    """``(N, in_dim) -> (N, out_dim)``: the gated sum of each row's kept experts, plus the shared
    expert. Rows are tokens of the sequence layers or samples of a Wukong layer."""

    reports_moe_stats = True
    """Modules with this flag and ``last_aux_loss``/``last_stats`` are what the model's
    ``auxiliary_losses`` and ``step_stats`` read (strategies that swap in another MoE layer,
    such as DeepSpeed's, keep the flag and the two attributes)."""

    def __init__(self, kind: str, in_dim: int, hidden: int, out_dim: int, *, num_experts: int,
                 top_k: int, capacity_factor: float, shared_expert: bool,
                 aux_loss_weight: float, impl: str) -> None:
        super().__init__()
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {', '.join(IMPLS)}; got {impl!r}")
        self.impl, self.aux_loss_weight = impl, aux_loss_weight
        self.num_experts, self.top_k = num_experts, top_k
        self.router = TopKRouter(in_dim, num_experts, top_k, capacity_factor)
        self.experts = ExpertMLPs(kind, num_experts, in_dim, hidden, out_dim)
        self.shared = ExpertMLPs(kind, 1, in_dim, hidden, out_dim) if shared_expert else None
        self.dispatcher: Dispatcher | None = None
        self._last = moe_last_forward()

    @property
    def last_aux_loss(self) -> Tensor | None:
        """Weighted load-balancing loss of the last training forward (None before one)."""
        return self._last.aux_loss

    @property
    def last_stats(self) -> dict[str, Tensor]:
        """Counts of the last training forward: ``tokens`` (E,) routed assignments per expert
        and ``dropped`` assignments over capacity."""
        return self._last.stats

    def forward(self, x: Tensor) -> Tensor:
        routing = self.router(x)
        if self.dispatcher is None and self.impl == "reference":
            out = self._reference(x, routing)
        else:
            out = self._grouped(x, routing)
        if self.shared is not None:
            out = out + self.shared.one(0, x)
        if self.training:
            self._last.aux_loss = self.aux_loss_weight * load_balancing_loss(routing)
            self._last.stats = {"tokens": routing.routed.detach(),
                                "dropped": (~routing.kept).sum().detach()}
        return out

    def _reference(self, x: Tensor, routing: Routing) -> Tensor:
        out = x.new_zeros(x.shape[0], self.experts.out_dim)
        for e in range(self.num_experts):
            chosen = ((routing.expert == e) & routing.kept).nonzero().squeeze(1)
            if chosen.numel() == 0:
                continue
            tokens = routing.token[chosen]
            gate = routing.gate[chosen].unsqueeze(1).to(x.dtype)
            out = out.index_add(0, tokens, self.experts.one(e, x[tokens]) * gate)
        return out

    def _grouped(self, x: Tensor, routing: Routing) -> Tensor:
        kept = routing.kept.nonzero().squeeze(1)
        expert = routing.expert[kept]
        order = torch.sort(expert, stable=True).indices
        chosen = kept[order]
        tokens = routing.token[chosen]
        counts = torch.bincount(expert, minlength=self.num_experts)
        rows = x[tokens]
        if self.dispatcher is not None:
            outputs = self.dispatcher.run(rows, counts, self.experts, self.impl)
        elif self.impl == "grouped":
            outputs = self.experts.grouped(rows, counts)
        else:
            outputs = self.experts.sequential(rows, counts)
        gate = routing.gate[chosen].unsqueeze(1).to(x.dtype)
        return x.new_zeros(x.shape[0], self.experts.out_dim).index_add(0, tokens, outputs * gate)

    def flops(self, rows: int) -> int:
        """Forward matmul FLOPs over ``rows`` rows with no assignment dropped: the router, the
        ``top_k`` active experts per row and the shared expert (inactive experts cost nothing)."""
        active = self.top_k + (1 if self.shared is not None else 0)
        return self.router.flops(rows) + rows * active * self.experts.flops_per_row()


def mlp_flops(module: nn.Module, rows: int) -> int:
    """Forward matmul FLOPs of an MLP slot over ``rows`` rows: the MoE layer's own count
    (active experts only) when the slot holds one (gem's or a strategy's stand-in), else every
    ``nn.Linear`` in it."""
    if getattr(module, "reports_moe_stats", False):
        return module.flops(rows)
    return linear_layer_flops(module, rows)


def build_moe(config: MoeConfig, kind: str, in_dim: int, hidden: int,
              out_dim: int) -> MixtureOfExperts:
    """The MoE layer ``config`` describes, in place of an MLP ``in_dim -> hidden -> out_dim``
    of ``kind`` (``swiglu`` or ``mlp``)."""
    return MixtureOfExperts(kind, in_dim, hidden, out_dim, num_experts=config.num_experts,
                            top_k=config.top_k, capacity_factor=config.capacity_factor,
                            shared_expert=config.shared_expert,
                            aux_loss_weight=config.aux_loss_weight, impl=config.impl)


def moe_layers(model: nn.Module) -> list[tuple[str, MixtureOfExperts]]:
    """Every mixture-of-experts layer of ``model`` with its qualified name (``moe`` for the
    model itself)."""
    return [(name or "moe", module) for name, module in model.named_modules()
            if isinstance(module, MixtureOfExperts)]


def reporting_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module that reports MoE losses and counts (``reports_moe_stats``)."""
    return [(name or "moe", module) for name, module in model.named_modules()
            if getattr(module, "reports_moe_stats", False)]


def auxiliary_losses(model: nn.Module) -> dict[str, Tensor]:
    """The weighted load-balancing loss of every MoE layer's last training forward."""
    return {f"{name}.load_balance": layer.last_aux_loss
            for name, layer in reporting_layers(model) if layer.last_aux_loss is not None}


def step_stats(model: nn.Module) -> dict[str, float]:
    """Additive counts of the last training forward (they sum across ranks):
    ``moe.<layer>.tokens.<e>`` routed assignments of expert e, ``moe.<layer>.dropped``."""
    stats: dict[str, float] = {}
    for name, layer in reporting_layers(model):
        if not layer.last_stats:
            continue
        for e, count in enumerate(layer.last_stats["tokens"].tolist()):
            stats[f"moe.{name}.tokens.{e}"] = float(count)
        stats[f"moe.{name}.dropped"] = float(layer.last_stats["dropped"])
    return stats


def summarize_step_stats(summed: dict[str, float]) -> dict[str, Any]:
    """Metrics from ``step_stats`` summed over ranks: per-layer token counts per expert, the
    load-balance figure (max/mean tokens per expert; 1.0 is perfect) per layer and its worst
    layer, and the dropped assignments of the step."""
    layers: dict[str, dict[int, float]] = {}
    dropped = 0.0
    for key, value in summed.items():
        if not key.startswith("moe."):
            continue
        name, _, rest = key[len("moe."):].rpartition(".tokens.")
        if name:
            layers.setdefault(name, {})[int(rest)] = value
        elif key.endswith(".dropped"):
            dropped += value
    if not layers:
        return {}
    tokens = {name: [counts[e] for e in sorted(counts)] for name, counts in layers.items()}
    balance = {name: (max(c) / (sum(c) / len(c)) if sum(c) else 1.0)
               for name, c in tokens.items()}
    return {"moe_tokens_per_expert": tokens, "moe_load_max_over_mean": balance,
            "moe_load_max_over_mean_worst": max(balance.values()),
            "moe_dropped_tokens": dropped}
