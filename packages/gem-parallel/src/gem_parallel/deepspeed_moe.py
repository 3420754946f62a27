"""``deepspeed-moe``: DeepSpeed's own MoE layer (``deepspeed.moe.layer.MoE``) and its expert
groups, under DeepSpeed ZeRO stage 0-2, for users who train on DeepSpeed.

Every gem ``MixtureOfExperts`` is swapped for an adapter holding a DeepSpeed MoE layer built from
it: the same router weights (DeepSpeed's ``TopKGate`` computes in fp32 too), the same experts
(each a small module of the same kind, with the same weights) and the same top-k; the shared
expert stays gem's and is added to DeepSpeed's output. DeepSpeed spreads the experts over
``ep_size`` ranks (its ``ep_size_N`` process groups, created by ``deepspeed.initialize``) and
dispatches with its own all-to-all; expert gradients are averaged over the expert-data-parallel
group by DeepSpeed, the rest over all ranks.

Differences from gem's layer: DeepSpeed's capacity rule counts a rank's own tokens, but its
all-to-all needs equal capacities on all ranks, which jagged histories (different token counts
per rank) break; so the capacity is taken from the expert group's largest token count (an
all-reduce before each gate), and DeepSpeed drops in its own order. ``capacity_factor = 0`` runs
DeepSpeed's no-drop mode (capacity = the busiest expert's load over the expert group); top-1
routing needs it. Its load-balancing loss counts first choices only in ``ce``; its token counts
per expert are ``exp_counts``. Only layers whose input and output widths are equal can be
swapped (DeepSpeed reshapes the output to the input's shape): the sequence layers' MoE, not the
Wukong one. Checkpoints hold the full weights under gem's names and every rank's ZeRO
partitions; a resume needs the same ranks and ``ep_size``.

One process (no launcher) runs with ``ep_size`` 1: the strategy starts a one-rank process group
(``gem_core.distributed.single_process_group``), which ``deepspeed.initialize`` adopts instead of
looking for RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, and which is destroyed through
``deepspeed.comm`` so that DeepSpeed forgets its cached groups with it.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any, Callable

import attrs
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from gem_core.config.validators import at_least, choice
from gem_core.contracts import DenseSharding, require_strategy_model
from gem_core.distributed import ParallelContext, single_process_group
from gem_core.errors import GemConfigError
from gem_core.model.moe import MixtureOfExperts, moe_last_forward
from gem_core.model.moe_experts import ExpertMLPs
from gem_core.plan_estimate import (
    Estimate,
    PlanFacts,
    adam_memory,
    moe_all_to_all_bytes,
    ring_fraction,
)
from gem_parallel.deepspeed_zero import (
    DEEPSPEED_CHECKPOINT_CLASSES,
    DeepSpeedEngine,
    deepspeed_config,
    destroy_with_deepspeed,
    local_rank_for_deepspeed,
    zero_estimate,
)
from gem_parallel.eval_replica import EvalReplica


@attrs.frozen(kw_only=True)
class DeepSpeedMoeOptions:
    """``[parallel.dense]`` of ``deepspeed-moe``."""

    ep_size: int = attrs.field(default=0, validator=at_least(0))
    """Ranks over which DeepSpeed spreads each layer's experts; 0: all ranks."""

    zero_stage: int = attrs.field(default=1, validator=choice(0, 1, 2))
    """ZeRO stage for the optimizer (DeepSpeed's MoE does not support stage 3)."""


class _SwiGluExpert(nn.Module):
    def __init__(self, dim: int, hidden: int, out_dim: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, out_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class _MlpExpert(nn.Module):
    def __init__(self, dim: int, hidden: int, out_dim: int) -> None:
        super().__init__()
        self.w_in = nn.Linear(dim, hidden)
        self.w_out = nn.Linear(hidden, out_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_out(F.silu(self.w_in(x)))


def _expert_module(experts: ExpertMLPs) -> nn.Module:
    cls = _SwiGluExpert if experts.kind == "swiglu" else _MlpExpert
    return cls(experts.in_dim, experts.hidden, experts.out_dim)


def _load_expert(module: nn.Module, experts: ExpertMLPs, e: int) -> None:
    """Copy gem's stacked expert ``e`` ((in, out) matrices) into an expert module."""
    with torch.no_grad():
        if experts.kind == "swiglu":
            module.gate.weight.copy_(experts.gate[e].t())
            module.up.weight.copy_(experts.up[e].t())
            module.down.weight.copy_(experts.down[e].t())
        else:
            module.w_in.weight.copy_(experts.w_in[e].t())
            module.w_in.bias.copy_(experts.b_in[e])
            module.w_out.weight.copy_(experts.w_out[e].t())
            module.w_out.bias.copy_(experts.b_out[e])


def _stacked(modules: list[nn.Module], kind: str) -> dict[str, Tensor]:
    """The inverse of ``_load_expert`` over a list of expert modules: gem's stacked tensors."""
    def stack(get: Callable[[nn.Module], Tensor]) -> Tensor:
        return torch.stack([get(m).detach() for m in modules])

    if kind == "swiglu":
        return {"gate": stack(lambda m: m.gate.weight.t()), "up": stack(lambda m: m.up.weight.t()),
                "down": stack(lambda m: m.down.weight.t())}
    return {"w_in": stack(lambda m: m.w_in.weight.t()), "b_in": stack(lambda m: m.w_in.bias),
            "w_out": stack(lambda m: m.w_out.weight.t()), "b_out": stack(lambda m: m.w_out.bias)}


class DeepSpeedMoeAdapter(nn.Module):
    """Stands in for a gem ``MixtureOfExperts``: DeepSpeed's MoE plus gem's shared expert, and
    the same ``last_aux_loss``/``last_stats`` the trainer reads."""

    reports_moe_stats = True

    def __init__(self, layer: MixtureOfExperts, *, ep_size: int, ep_rank: int) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        experts = layer.experts
        if experts.in_dim != experts.out_dim:
            raise GemConfigError(
                f"dense_sharding 'deepspeed-moe': DeepSpeed's MoE layer reshapes its output to "
                f"its input's shape, so it cannot replace a {experts.in_dim} -> "
                f"{experts.out_dim} MoE (the Wukong one); use model.moe.where = ['sequence'] "
                "or --sharding ep")
        self.capacity_factor = layer.router.capacity_factor
        if self.capacity_factor > 0 and layer.top_k < 2:
            raise GemConfigError(
                "dense_sharding 'deepspeed-moe' with top_k = 1 needs model.moe.capacity_factor "
                "= 0: every rank must use the same capacity (DeepSpeed's all-to-all sends every "
                "expert's full buffer), which this strategy takes from the rank with the most "
                "tokens, and DeepSpeed's top-1 gate refuses a capacity above a rank's own token "
                "count; use top_k >= 2, capacity_factor = 0, or --sharding ep")
        self.kind, self.num_experts, self.top_k = experts.kind, layer.num_experts, layer.top_k
        self.ep_size, self.ep_rank = ep_size, ep_rank
        self.aux_loss_weight = layer.aux_loss_weight
        # capacity_factor 0: DeepSpeed's no-drop mode (capacity = the busiest expert's load over
        # the expert group). Above 0: DeepSpeed's rule ceil(factor * k * tokens / E), with the
        # tokens of the expert group's largest rank (see _uniform_capacity).
        dropping = self.capacity_factor > 0
        self.moe = MoE(experts.in_dim, _expert_module(experts), num_experts=layer.num_experts,
                       ep_size=ep_size, k=layer.top_k,
                       capacity_factor=self.capacity_factor if dropping else 1.0,
                       eval_capacity_factor=self.capacity_factor if dropping else 1.0,
                       min_capacity=0, drop_tokens=dropping, use_rts=False,
                       noisy_gate_policy=None, top2_2nd_expert_sampling=False)
        with torch.no_grad():
            self.moe.deepspeed_moe.gate.wg.weight.copy_(layer.router.weight)
        local = layer.num_experts // ep_size
        for i, module in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
            _load_expert(module, experts, ep_rank * local + i)
        self.shared = layer.shared
        self._flops_per_row = layer.flops(1)  # router + active experts, as gem counts them
        self._last = moe_last_forward()
        self._dropped: Tensor | None = None
        self.moe.deepspeed_moe.gate.register_forward_hook(self._count_dropped)
        if dropping:
            self.moe.deepspeed_moe.gate.register_forward_pre_hook(self._uniform_capacity)

    def _uniform_capacity(self, gate: nn.Module, args: Any) -> None:
        """DeepSpeed sizes the capacity from this rank's tokens, but its all-to-all sends every
        expert's full capacity buffer, so the ranks of an expert group must agree: set the
        gate's floor (``min_capacity``) from the group's largest token count (one all-reduce of
        an integer per layer and forward; jagged histories give ranks different counts)."""
        tokens = torch.tensor([args[0].shape[0]], dtype=torch.int64, device=args[0].device)
        group = getattr(gate, "ep_group", None)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(tokens, op=dist.ReduceOp.MAX, group=group)
        gate.min_capacity = math.ceil(self.capacity_factor * self.top_k * int(tokens)
                                      / self.num_experts)

    def _count_dropped(self, module: nn.Module, args: Any, output: Any) -> None:
        # With sparse routes (what MOELayer asks for) the gate returns
        # (l_aux, capacity, E, indices (k, S), locations, gates, exp_counts); a dropped
        # assignment's expert index is -1.
        if not isinstance(output, tuple) or len(output) != 7:
            raise RuntimeError("deepspeed-moe: this DeepSpeed's TopKGate returns "
                               f"{type(output).__name__} of {len(output)}, not the 7-tuple of "
                               "sparse routes (tested with DeepSpeed 0.19.8)")
        self._dropped = (output[3] < 0).sum().detach()

    def flops(self, rows: int) -> int:
        return rows * self._flops_per_row

    @property
    def last_aux_loss(self) -> Tensor | None:
        return self._last.aux_loss

    @property
    def last_stats(self) -> dict[str, Tensor]:
        return self._last.stats

    def forward(self, x: Tensor) -> Tensor:
        out, aux, counts = self.moe(x)
        if self.shared is not None:
            out = out + self.shared.one(0, x)
        if self.training:
            self._last.aux_loss = self.aux_loss_weight * aux
            self._last.stats = {"tokens": counts.detach(), "dropped": self._dropped}
        return out

    def full_state(self, prefix: str, ep_group) -> dict[str, Tensor]:
        """This layer's weights under gem's names (experts gathered over the expert-parallel
        group: a collective)."""
        local = _stacked(list(self.moe.deepspeed_moe.experts.deepspeed_experts), self.kind)
        size = dist.get_world_size(ep_group) if ep_group is not None else 1
        state = {f"{prefix}.router.weight":
                 self.moe.deepspeed_moe.gate.wg.weight.detach().float().cpu()}
        for name, tensor in local.items():
            parts = [torch.empty_like(tensor) for _ in range(size)]
            if size > 1:
                dist.all_gather(parts, tensor.contiguous(), group=ep_group)
            else:
                parts = [tensor]
            state[f"{prefix}.experts.{name}"] = torch.cat(parts).cpu()
        if self.shared is not None:
            for name, tensor in self.shared.named_parameters():
                state[f"{prefix}.shared.{name}"] = tensor.detach().cpu()
        return state


    def load_full_state(self, prefix: str, state: dict[str, Tensor]) -> None:
        """The inverse of :meth:`full_state` on this rank: the router, this rank's experts out
        of gem's stacked tensors, and the shared expert."""
        names = ("gate", "up", "down") if self.kind == "swiglu" else (
            "w_in", "b_in", "w_out", "b_out")
        stacked = SimpleNamespace(kind=self.kind,
                                  **{n: state[f"{prefix}.experts.{n}"] for n in names})
        local = self.num_experts // self.ep_size
        with torch.no_grad():
            self.moe.deepspeed_moe.gate.wg.weight.copy_(state[f"{prefix}.router.weight"])
            for i, module in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
                _load_expert(module, stacked, self.ep_rank * local + i)
            if self.shared is not None:
                for name, tensor in self.shared.named_parameters():
                    tensor.copy_(state[f"{prefix}.shared.{name}"])


class DeepSpeedMoeStrategy(DenseSharding):
    name = "deepspeed-moe"
    checkpoint_classes = DEEPSPEED_CHECKPOINT_CLASSES

    def apply(self, model: nn.Module, *, ctx: ParallelContext, make_optimizer: Callable,
              precision, options: DeepSpeedMoeOptions) -> "DeepSpeedMoeEngine":
        opts = options
        layers = require_strategy_model(model, f"dense_sharding {self.name!r}",
                                        "moe_layers").moe_layers()
        if not layers:
            raise GemConfigError("dense_sharding 'deepspeed-moe' needs a model with MoE layers; "
                                 "set model.moe.num_experts (e.g. --preset tiny-moe)")
        ep_size = opts.ep_size or ctx.world_size
        if ctx.world_size % ep_size:
            raise GemConfigError(f"parallel.dense.ep_size ({ep_size}) must divide the number "
                                 f"of ranks ({ctx.world_size})")
        for name, layer in layers:
            if layer.num_experts % ep_size:
                raise GemConfigError(
                    f"dense_sharding 'deepspeed-moe': {name} has {layer.num_experts} experts, "
                    f"which {ep_size} expert-parallel ranks cannot share evenly")
        dtype = precision.compute_dtype
        if dtype not in ("float32", "bfloat16"):
            raise RuntimeError(f"dense_sharding 'deepspeed-moe' supports float32 and bfloat16 "
                               f"recipes; {precision.name!r} computes in {dtype}")
        if not ctx.is_distributed:
            # One process: ep_size 1, every expert local. deepspeed.initialize adopts an
            # existing torch.distributed group; without one it would look for a launcher's
            # RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (then MPI).
            single_process_group(ctx, destroy=destroy_with_deepspeed)
        import deepspeed
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        replica = EvalReplica(model)  # gem's layers: evaluation runs without collectives
        # DeepSpeed's expert groups: rank r is expert-parallel rank r % ep_size (it groups
        # consecutive ranks).
        ep_rank = ctx.rank % ep_size
        adapters = {}
        for name, layer in layers:
            owner_name, _, leaf = name.rpartition(".")
            owner = model.get_submodule(owner_name) if owner_name else model
            # DeepSpeed's layer initialises its gate and experts (overwritten from gem's
            # weights right after): keep the global RNG, which data order depends on, untouched.
            with torch.random.fork_rng(devices=[]):
                adapter = DeepSpeedMoeAdapter(layer, ep_size=ep_size, ep_rank=ep_rank)
            setattr(owner, leaf, adapter.to(ctx.device))
            adapters[name] = adapter
        built = make_optimizer(model)
        # DeepSpeed wants expert parameters in their own groups (named per expert group).
        groups = split_params_into_different_moe_groups_for_optimizer(
            [{**g, "name": f"group{i}"} for i, g in enumerate(built.param_groups)])
        optimizer, optimizer.param_groups = built, []  # no state yet: regroup in place
        for group in groups:
            optimizer.add_param_group(group)
        local_rank_for_deepspeed(ctx)
        ds_engine, ds_optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer,
            config=deepspeed_config(opts.zero_stage, world_size=ctx.world_size,
                                    bf16=dtype == "bfloat16"))
        from deepspeed.utils import groups as ds_groups

        ep_group = ds_groups._get_expert_parallel_group(f"ep_size_{ep_size}") \
            if ep_size > 1 else None
        return DeepSpeedMoeEngine(ds_engine, ds_optimizer, unwrapped=model, replica=replica,
                                  adapters=adapters, ep_group=ep_group)

    def plan_estimate(self, facts: PlanFacts, options: DeepSpeedMoeOptions) -> Estimate:
        """Non-expert parameters under ZeRO ``zero_stage`` over every rank; each rank keeps
        ``1 / ep_size`` of every layer's experts, whose moments (stage >= 1) and gradients
        (stage 2) ZeRO partitions over the ``ranks / ep_size`` copies, which all-reduce the
        expert gradients. DeepSpeed's all-to-all sends every capacity slot, filled or not: the
        rows are ``max(capacity_factor, 1)`` x the routed ones (no-drop mode: the busiest
        expert's load, the mean under uniform routing)."""
        opts = options
        n = facts.world_size
        ep = opts.ep_size or n
        if n % ep:
            raise ValueError(f"ep_size {ep} does not divide {n} GPUs")
        if not facts.moe_layers:
            raise ValueError("the deepspeed-moe layout needs a model with MoE layers "
                             "(model.moe.num_experts)")
        for layer in facts.moe_layers:
            if layer.in_dim != layer.out_dim or layer.num_experts % ep:
                raise ValueError(f"deepspeed-moe cannot take {layer.name} ({layer.num_experts} "
                                 f"experts, {layer.in_dim} -> {layer.out_dim}) with ep_size {ep}")
        expert_params = facts.expert_parameters
        copies = n // ep
        held = expert_params / ep
        estimate = zero_estimate(opts.zero_stage, facts.dense_parameters - expert_params, n)
        memory = dict(estimate.memory)
        memory.update(adam_memory("expert", held,
                                  grads_over=copies if opts.zero_stage >= 2 else 1,
                                  optimizer_over=copies if opts.zero_stage >= 1 else 1))
        reduce_bytes = 2 * ring_fraction(copies) * held * 4
        all_to_all = sum(moe_all_to_all_bytes(layer.rows * max(layer.capacity_factor, 1.0),
                                              top_k=layer.top_k, in_dim=layer.in_dim,
                                              out_dim=layer.out_dim, ep_size=ep)
                         for layer in facts.moe_layers)
        return Estimate(memory=memory,
                        communication={"dense": estimate.communication["dense"] + reduce_bytes,
                                       "moe_all_to_all": all_to_all},
                        details={"experts": {"expert_parameters": expert_params,
                                             "params_held": int(held), "ep_size": ep,
                                             "copies": copies, "zero_stage": opts.zero_stage,
                                             "grad_reduce_bytes": int(reduce_bytes),
                                             "all_to_all_bytes": int(all_to_all)}})


class DeepSpeedMoeEngine(DeepSpeedEngine):
    """DeepSpeed's engine; evaluation on a replica with gem's layers (DeepSpeed's MoE runs
    all-to-alls, which ranks with different numbers of eval batches cannot); checkpoints hold
    the full weights under gem's names and every rank's ZeRO partitions, and resume with the
    same ranks and ``ep_size``."""

    def __init__(self, ds_engine, optimizer, *, unwrapped: nn.Module, replica: EvalReplica,
                 adapters: dict[str, DeepSpeedMoeAdapter], ep_group) -> None:
        super().__init__(ds_engine, optimizer, unwrapped=unwrapped, replica=replica)
        self.adapters, self.ep_group = adapters, ep_group

    def clip_grad_norm(self, max_norm: float) -> Tensor:
        """As DeepSpeedEngine's, but a rank's expert gradients are only its own experts':
        their squares are summed over the expert-parallel group (each expert once), the
        others' are the same on every rank."""
        from deepspeed.moe.utils import is_moe_param
        from deepspeed.utils import safe_get_full_grad

        self.ds.optimizer.clip_grad = max_norm
        device = next(self.unwrapped.parameters()).device  # where the group communicates
        dense = torch.zeros((), dtype=torch.float64, device=device)
        experts = torch.zeros((), dtype=torch.float64, device=device)
        for _, param in self._named_parameters():
            grad = safe_get_full_grad(param)  # a collective: every rank, same order
            if grad is not None:
                squares = grad.double().pow(2).sum().to(device)
                if is_moe_param(param):
                    experts += squares
                else:
                    dense += squares
        if self.ep_group is not None:
            dist.all_reduce(experts, group=self.ep_group)
        return (dense + experts).sqrt().float().cpu()

    def _full_model_state(self) -> dict[str, Tensor]:
        from deepspeed.utils import safe_get_full_fp32_param

        state: dict[str, Tensor] = {}
        for name, param in self._named_parameters():
            if not any(name.startswith(f"{prefix}.") for prefix in self.adapters):
                state[name] = safe_get_full_fp32_param(param).detach().cpu()
        for prefix, adapter in self.adapters.items():
            state.update(adapter.full_state(prefix, self.ep_group))
        buffers = dict(self.unwrapped.named_buffers())
        state.update({k: v.cpu() for k, v in self.unwrapped.state_dict().items()
                      if k in buffers and k not in state})
        return state

    def state_dict(self) -> dict[str, Any]:
        """DeepSpeedEngine's, plus the expert layout the ZeRO partitions belong to."""
        state = super().state_dict()
        state["optimizer"]["expert_parallel"] = self._layout()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Same ranks and expert layout only (the trainer checks the ranks): each rank's ZeRO
        partitions hold the optimizer state of its own experts."""
        saved = state["optimizer"].get("expert_parallel")
        if saved != self._layout():
            raise RuntimeError(
                f"this deepspeed-moe checkpoint was written with expert layout {saved}; this "
                f"run has {self._layout()}: resume with the same parallel.dense.ep_size, or "
                "start over with --fresh")
        super().load_state_dict(state)

    def _layout(self) -> dict[str, int]:
        ep_size = next(iter(self.adapters.values())).ep_size if self.adapters else 1
        return {"ep_size": ep_size, "world_size": dist.get_world_size()}

    def _load_module_weights(self, full: dict[str, Tensor]) -> None:
        for name, param in self._named_parameters():
            if not any(name.startswith(f"{prefix}.") for prefix in self.adapters):
                param.copy_(full[name])
        for prefix, adapter in self.adapters.items():
            adapter.load_full_state(prefix, full)
