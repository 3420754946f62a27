"""Top-k token-choice routing of a mixture of experts, computed in float32.

Each token picks its ``top_k`` experts by router probability. An expert takes at most
``capacity`` assignments per forward; assignments beyond it are dropped in a fixed priority
order: all first choices before any second choice, and within one choice rank earlier tokens
first (GShard's order). A dropped assignment contributes nothing: the token keeps its residual
(and the shared expert when there is one).
"""

from __future__ import annotations

import math

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn


@attrs.frozen(kw_only=True)
class Routing:
    """One forward's routing decisions, flattened to assignments (token, choice) in
    choice-major order: assignment ``j`` is choice ``j // T`` of token ``j % T``."""

    probs: Tensor
    """``(T, E)`` float32 (float64 for float64 inputs) router probabilities."""

    expert: Tensor
    """``(k * T,)`` int64 chosen expert of every assignment."""

    token: Tensor
    """``(k * T,)`` int64 token of every assignment."""

    gate: Tensor
    """``(k * T,)`` float32 combine weight of every assignment (top-k probabilities,
    renormalised to sum to 1 over a token's choices when ``k > 1``)."""

    kept: Tensor
    """``(k * T,)`` bool: the assignment fits in its expert's capacity."""

    routed: Tensor
    """``(E,)`` int64 assignments routed to each expert before capacity (its demand)."""


def expert_capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Assignments one expert may take: ``ceil(capacity_factor * tokens * top_k / E)``;
    ``capacity_factor = 0`` means no limit (never drop)."""
    if capacity_factor <= 0:
        return tokens * top_k
    if torch.compiler.is_compiling():
        # ``tokens`` is a size symbol under torch.export, whose programs cannot serialise
        # math.ceil: the same ceiling in integers, with the factor's exact binary fraction.
        numerator, denominator = float(capacity_factor).as_integer_ratio()
        return -(-numerator * tokens * top_k // (denominator * num_experts))
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


class TopKRouter(nn.Module):
    """A bias-free float32 linear map to expert logits, softmax, top-k and the capacity rule."""

    def __init__(self, dim: int, num_experts: int, top_k: int, capacity_factor: float) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be between 1 and num_experts ({num_experts}); "
                             f"got {top_k}")
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.weight = nn.Parameter(torch.empty(num_experts, dim, dtype=torch.float32))
        # Small logits at the start: routing begins near uniform and the load-balancing loss
        # keeps it there while the experts specialise.
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: Tensor) -> Routing:
        tokens = x.shape[0]
        # At least fp32 whatever the autocast or parameter dtype: routing decisions are
        # discrete and bf16 logits flip near-ties between steps (float64 stays float64).
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.to(dtype), self.weight.to(dtype))
        probs = logits.softmax(dim=-1)
        top_p, top_e = probs.topk(self.top_k, dim=-1)  # (T, k)
        if self.top_k > 1:
            top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        # contiguous + view, not reshape: under torch.export reshape's view check would
        # specialise the program to more than one token.
        expert = top_e.t().contiguous().view(-1)
        gate = top_p.t().contiguous().view(-1)
        token = torch.arange(tokens, device=x.device).repeat(self.top_k)
        routed = torch.bincount(expert, minlength=self.num_experts)
        capacity = expert_capacity(tokens, self.top_k, self.num_experts, self.capacity_factor)
        # Position of each assignment in its expert's queue: a stable sort by expert keeps the
        # choice-major, token order within an expert.
        order = torch.sort(expert, stable=True).indices
        starts = torch.cumsum(routed, 0) - routed
        position = torch.empty_like(order)
        position[order] = torch.arange(order.numel(), device=x.device) - starts[expert[order]]
        return Routing(probs=probs, expert=expert, token=token, gate=gate,
                       kept=position < capacity, routed=routed)

    def flops(self, rows: int) -> int:
        return 2 * rows * self.weight.shape[0] * self.weight.shape[1]


def load_balancing_loss(routing: Routing) -> Tensor:
    """Switch/GShard auxiliary loss ``E * sum_e f_e * P_e``: ``f_e`` the fraction of routed
    assignments that chose expert e (all k choices, before capacity), ``P_e`` the mean router
    probability of e. It is 1 when routing is uniform and grows as load concentrates; only
    ``P_e`` carries gradient."""
    tokens, experts = routing.probs.shape
    if tokens == 0:
        return routing.probs.sum() * 0.0
    fraction = routing.routed.to(routing.probs.dtype) / routing.expert.numel()
    return experts * torch.sum(fraction * routing.probs.mean(dim=0))
