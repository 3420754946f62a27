"""``ep``: expert parallelism composed with FSDP2.

The ranks form a 2-D DeviceMesh ``("edp", "ep")``: the ``ep`` dimension holds one copy of every
expert, ``num_experts / ep_size`` per rank (rank ``i`` of an ``ep`` group owns experts
``[i * E_local, (i + 1) * E_local)`` of every MoE layer); the ``edp`` dimension replicates that
copy (``world_size / ep_size`` copies). Each MoE layer routes its own rows, then the dispatcher
this strategy installs on it sends them to the ranks that own their experts with
``all_to_all_single`` (the row counts are exchanged first, also with an all-to-all), runs the
local experts on what arrived (grouped or one after another, per ``model.moe.impl``) and sends
the outputs back the same way. Both all-to-alls are differentiable: the backward sends the
gradients along the reverse path.

Every other parameter (attention, routers, shared experts, embeddings, heads) is sharded with
FSDP2 over all ranks, as ``fsdp2`` does. Expert weights stay plain tensors outside FSDP; after
the backward their gradients are summed over ``edp`` and divided by the number of ranks, which
is what FSDP's averaging does for the rest. With ``expert_fsdp`` each rank's experts are instead
FSDP2-sharded over their copies (the ``edp`` group): the dispatcher's calls into the experts are
registered as FSDP forward methods, so they are all-gathered around each MoE layer's forward and
backward and their gradients reduce-scattered over ``edp`` (divided by the number of ranks).

One process (or ``ep_size`` 1) is the degenerate layout: every expert is local, so no dispatcher
is installed and the layer runs its experts itself; the strategy starts a one-rank process group
for DeviceMesh and FSDP2 when there is none (``gem_core.distributed.single_process_group``).
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, distribute_tensor

from gem_core.config.validators import at_least
from gem_core.contracts import DenseSharding, require_strategy_model
from gem_core.distributed import ParallelContext, single_process_group
from gem_core.engine import Engine, clipped_parameters, local_cpu_copy, scale_to_max_norm
from gem_core.errors import GemConfigError
from gem_core.model.moe import MixtureOfExperts
from gem_core.model.moe_experts import ExpertMLPs
from gem_core.plan_estimate import (
    Estimate,
    MemoryRow,
    PlanFacts,
    adam_memory,
    dense_memory,
    moe_all_to_all_bytes,
    ring_fraction,
)
from gem_core.train.table_optimizer import row_state
from gem_parallel.eval_replica import EvalReplica


@attrs.frozen(kw_only=True)
class EpOptions:
    """``[parallel.dense]`` of ``ep``."""

    ep_size: int = attrs.field(default=0, validator=at_least(0))
    """Ranks that share one copy of the experts (each holds ``num_experts / ep_size`` of every
    MoE layer); 0: all ranks. The number of ranks must be a multiple of it."""

    reshard_after_forward: bool = True
    """As for ``fsdp2``: free gathered block parameters after the forward."""

    expert_fsdp: bool = False
    """FSDP2-shard each rank's experts over their copies (the ``edp`` group, ``ranks / ep_size``
    of them): a rank stores that fraction of its experts and all-gathers them for every MoE
    layer's forward and backward. False: whole expert tensors on every copy, gradients
    all-reduced over ``edp``."""


@attrs.define
class Traffic:
    """Bytes this rank passed to the dispatch and combine all-to-alls (forward and backward)."""

    bytes_total: int = 0
    """Every row handed to all_to_all_single, including the part a rank sends to itself."""

    bytes_remote: int = 0
    """Only the rows that leave the rank (what the network carries)."""

    calls: int = 0

    def reset(self) -> None:
        self.bytes_total = self.bytes_remote = self.calls = 0


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with split sizes; the backward sends gradients the reverse way."""

    @staticmethod
    def forward(ctx, x: Tensor, output_splits: list[int], input_splits: list[int], group,
                traffic: Traffic, rank: int) -> Tensor:
        ctx.splits, ctx.group, ctx.traffic, ctx.rank = (output_splits, input_splits), group, \
            traffic, rank
        return _exchange(x, output_splits, input_splits, group, traffic, rank)

    @staticmethod
    def backward(ctx, grad: Tensor):
        output_splits, input_splits = ctx.splits
        back = _exchange(grad, input_splits, output_splits, ctx.group, ctx.traffic, ctx.rank)
        return back, None, None, None, None, None


def _exchange(x: Tensor, output_splits: list[int], input_splits: list[int], group,
              traffic: Traffic, rank: int) -> Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    row_bytes = x.element_size() * (x.shape[1:].numel() if x.dim() > 1 else 1)
    traffic.bytes_total += sum(input_splits) * row_bytes
    traffic.bytes_remote += (sum(input_splits) - input_splits[rank]) * row_bytes
    traffic.calls += 1
    return out


class ExpertParallelDispatcher:
    """Installed as ``MixtureOfExperts.dispatcher``: runs expert-sorted rows on the ranks of
    ``group`` that own their experts and returns the outputs in the same order."""

    def __init__(self, group, *, ep_rank: int, ep_size: int, num_experts: int,
                 traffic: Traffic) -> None:
        self.group, self.ep_rank, self.ep_size = group, ep_rank, ep_size
        self.local_experts = num_experts // ep_size
        self.traffic = traffic

    def run(self, rows: Tensor, counts: Tensor, experts: ExpertMLPs, impl: str) -> Tensor:
        ep, local = self.ep_size, self.local_experts
        if torch.is_grad_enabled() and not rows.requires_grad:
            # Every rank must run the dispatch's backward (a collective), even one whose rows
            # need no gradient (e.g. frozen inputs): make them part of the graph.
            rows = rows.detach().requires_grad_(True)
        # Rows per (destination rank, its local expert) -> rows per (source rank, my expert).
        send = counts.view(ep, local)
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send.contiguous(), group=self.group)
        input_splits = send.sum(1).tolist()
        output_splits = received.sum(1).tolist()
        arrived = _AllToAll.apply(rows, output_splits, input_splits, self.group, self.traffic,
                                  self.ep_rank)
        # Arrived rows are grouped by source, then by my expert: group them by my expert.
        expert_of_row = torch.repeat_interleave(
            torch.arange(local, device=rows.device).repeat(ep), received.flatten(),
            output_size=arrived.shape[0])
        order = torch.sort(expert_of_row, stable=True).indices
        per_expert = received.sum(0)
        sorted_rows = arrived[order]
        outputs = (experts.grouped(sorted_rows, per_expert) if impl == "grouped"
                   else experts.sequential(sorted_rows, per_expert))
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return _AllToAll.apply(outputs[inverse], input_splits, output_splits, self.group,
                               self.traffic, self.ep_rank)


def moe_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The MoE layers by qualified name: a model's through its interface (``moe_layers``), or
    a lone MoE layer itself, named ``moe`` (the helpers below also shard one layer)."""
    if isinstance(model, MixtureOfExperts):
        return [("moe", model)]
    return require_strategy_model(model, "dense_sharding 'ep'", "moe_layers").moe_layers()


class LocalDispatcher:
    """Every expert on this rank (``ep_size`` 1) with FSDP-sharded experts: calls the experts
    through one FSDP forward method per forward (``grouped`` or ``sequential``), never the
    layer's per-expert reference loop, whose calls (each an all-gather) vary between ranks."""

    def run(self, rows: Tensor, counts: Tensor, experts: ExpertMLPs, impl: str) -> Tensor:
        return (experts.grouped(rows, counts) if impl == "grouped"
                else experts.sequential(rows, counts))


def fsdp_shard_experts(model: nn.Module, edp_mesh: DeviceMesh, *, policy: MixedPrecisionPolicy,
                       reshard_after_forward: bool, divide_by: int) -> None:
    """FSDP2 over ``edp`` for each MoE layer's (local) experts, whose ``grouped`` and
    ``sequential`` calls become FSDP forward methods (the dispatcher calls those, not
    ``forward``); gradients are reduce-scattered and divided by ``divide_by``."""
    for _, layer in moe_layers(model):
        if layer.dispatcher is None:
            layer.dispatcher = LocalDispatcher()
        fully_shard(layer.experts, mesh=edp_mesh, mp_policy=policy,
                    reshard_after_forward=reshard_after_forward)
        for method in ("grouped", "sequential"):
            register_fsdp_forward_method(layer.experts, method)
        layer.experts.set_gradient_divide_factor(float(divide_by))
        if divide_by != edp_mesh.size():
            # Any factor but the group size is a PREMUL_SUM reduce-scatter, which gloo lacks
            # ("Cannot use ReduceOp.PREMUL_SUM with Gloo"): sum, then divide.
            layer.experts.set_force_sum_reduction_for_comms(True)


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The routed experts' stacked weights of every MoE layer (not routers or shared experts)."""
    return [p for _, layer in moe_layers(model) for p in layer.experts.parameters()]


def shard_experts(model: nn.Module, *, group, ep_rank: int, ep_size: int,
                  traffic: Traffic | None = None) -> Traffic:
    """Keep this rank's ``num_experts / ep_size`` experts of every MoE layer and install the
    all-to-all dispatcher. Returns the traffic counter the dispatchers share."""
    traffic = traffic or Traffic()
    layers = moe_layers(model)
    if not layers:
        raise GemConfigError("dense_sharding 'ep' needs a model with MoE layers; set "
                             "model.moe.num_experts (e.g. --preset tiny-moe)")
    for name, layer in layers:
        if layer.num_experts % ep_size:
            raise GemConfigError(
                f"dense_sharding 'ep': {name} has {layer.num_experts} experts, which "
                f"{ep_size} expert-parallel ranks cannot share evenly; choose "
                "parallel.dense.ep_size dividing model.moe.num_experts")
        if ep_size == 1:
            # This rank holds every expert: the layer runs them itself, as without ``ep``
            # (no dispatcher, no all-to-all); their gradients are still reduced over ``edp``.
            continue
        local = layer.num_experts // ep_size
        lo = ep_rank * local
        for pname, param in list(layer.experts.named_parameters(recurse=False)):
            setattr(layer.experts, pname,
                    nn.Parameter(param.detach()[lo:lo + local].clone(),
                                 requires_grad=param.requires_grad))
        layer.dispatcher = ExpertParallelDispatcher(group, ep_rank=ep_rank, ep_size=ep_size,
                                                    num_experts=layer.num_experts,
                                                    traffic=traffic)
    return traffic


def reduce_expert_grads(model: nn.Module, edp_group, *, divide_by: float) -> None:
    """Sum expert gradients over the copies of the experts (``edp``), then divide."""
    for param in expert_parameters(model):
        if isinstance(param, DTensor):
            raise RuntimeError("reduce_expert_grads: these experts are FSDP-sharded "
                               "(expert_fsdp), which reduces their gradients itself")
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        if edp_group is not None and dist.get_world_size(edp_group) > 1:
            dist.all_reduce(param.grad, group=edp_group)
        if divide_by != 1:
            param.grad.div_(divide_by)


def gather_expert_state(model: nn.Module, ep_group) -> dict[str, Tensor]:
    """Every expert's full weights (concatenated over the ``ep`` group) by parameter name.
    A collective over the group."""
    full: dict[str, Tensor] = {}
    size = dist.get_world_size(ep_group)
    for name, layer in moe_layers(model):
        for pname, param in layer.experts.named_parameters(recurse=False):
            # FSDP-sharded (expert_fsdp): gather over the copies first.
            local = param.full_tensor() if isinstance(param, DTensor) else param
            parts = [torch.empty_like(local) for _ in range(size)]
            dist.all_gather(parts, local.detach().contiguous(), group=ep_group)
            full[f"{name}.experts.{pname}"] = torch.cat(parts).cpu()
    return full


class ExpertParallelStrategy(DenseSharding):
    name = "ep"

    def mesh(self, ctx: ParallelContext, opts: EpOptions) -> tuple[DeviceMesh, DeviceMesh]:
        ep = opts.ep_size or ctx.world_size
        if ctx.world_size % ep:
            raise GemConfigError(f"parallel.dense.ep_size ({ep}) must divide the number of "
                                 f"ranks ({ctx.world_size})")
        experts_mesh = init_device_mesh(ctx.device.type, (ctx.world_size // ep, ep),
                                        mesh_dim_names=("edp", "ep"))
        dp_mesh = init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("dp",))
        return experts_mesh, dp_mesh

    def apply(self, model: nn.Module, *, ctx: ParallelContext, make_optimizer: Callable,
              precision, options: EpOptions) -> Engine:
        opts = options
        if not moe_layers(model):
            raise GemConfigError("dense_sharding 'ep' needs a model with MoE layers; set "
                                 "model.moe.num_experts (e.g. --preset tiny-moe)")
        if not ctx.is_distributed:
            # One process is the degenerate mesh (1, 1): every expert local, no all-to-all,
            # FSDP2 over one rank. DeviceMesh and FSDP2 still need a process group.
            single_process_group(ctx)
        experts_mesh, dp_mesh = self.mesh(ctx, opts)
        replica = EvalReplica(model)  # full experts, no dispatcher: evaluation runs locally
        traffic = shard_experts(model, group=experts_mesh.get_group("ep"),
                                ep_rank=experts_mesh.get_local_rank("ep"),
                                ep_size=experts_mesh.size(1))
        policy = precision.mixed_precision_policy() or MixedPrecisionPolicy()
        if opts.expert_fsdp:
            # Sharded first: the blocks' and the model's fully_shard then leave them to it.
            fsdp_shard_experts(model, experts_mesh["edp"], policy=policy,
                               reshard_after_forward=opts.reshard_after_forward,
                               divide_by=ctx.world_size)
            ignored: set[nn.Parameter] = set()
        else:
            ignored = set(expert_parameters(model))
        for block in require_strategy_model(model, "dense_sharding 'ep'",
                                            "parallel_units").parallel_units():
            fully_shard(block, mesh=dp_mesh, mp_policy=policy,
                        reshard_after_forward=opts.reshard_after_forward,
                        ignored_params=ignored & set(block.parameters()))
        fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=False,
                    ignored_params=ignored)
        return ExpertParallelEngine(model, make_optimizer(model), replica=replica,
                                    experts_mesh=experts_mesh, world_size=ctx.world_size,
                                    traffic=traffic, expert_fsdp=opts.expert_fsdp)

    def plan_estimate(self, facts: PlanFacts, options: EpOptions) -> Estimate:
        """Non-expert parameters FSDP2-sharded over every rank; each rank of an expert group
        keeps ``1 / ep_size`` of every layer's experts (``expert_fsdp``: a ``1 / ranks``
        shard), their gradients reduced over the ``ranks / ep_size`` copies; every MoE layer
        exchanges its routed rows with all-to-all (:func:`moe_all_to_all_bytes`)."""
        opts = options
        n = facts.world_size
        ep = opts.ep_size or n
        if n % ep:
            raise ValueError(f"ep_size {ep} does not divide {n} GPUs")
        expert_params = facts.expert_parameters
        if not expert_params:
            raise ValueError("the ep layout needs a model with MoE layers (model.moe.num_experts)")
        copies = n // ep
        held = expert_params / (n if opts.expert_fsdp else ep)
        group_bytes = expert_params * 4 / ep  # one expert group's share, fp32
        if copies == 1:
            reduce_bytes = 0.0
        elif opts.expert_fsdp:  # all-gather forward and backward, reduce-scatter gradients
            reduce_bytes = 3 * (copies - 1) / copies * group_bytes
        else:  # all-reduce of the gradients over the copies
            reduce_bytes = 2 * (copies - 1) / copies * group_bytes
        all_to_all = sum(moe_all_to_all_bytes(layer.rows, top_k=layer.top_k,
                                              in_dim=layer.in_dim, out_dim=layer.out_dim,
                                              ep_size=ep) for layer in facts.moe_layers)
        dense = facts.dense_parameters - expert_params
        memory: dict[str, MemoryRow] = dense_memory(facts, dense, params_over=n, grads_over=n,
                                                   optimizer_over=n)
        memory.update(adam_memory("expert", held))
        dense_bytes = int(3 * ring_fraction(n) * dense * 4) if n > 1 else 0
        experts = {"expert_parameters": expert_params, "params_held": held,
                   "grad_reduce_bytes": reduce_bytes, "all_to_all_bytes": all_to_all,
                   "ep_size": ep, "copies": copies}
        return Estimate(memory=memory,
                        communication={"dense": dense_bytes + reduce_bytes,
                                       "moe_all_to_all": all_to_all},
                        details={"experts": {k: (int(v) if isinstance(v, float) else v)
                                             for k, v in experts.items()}})


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class ExpertParallelEngine(Engine):
    """FSDP2 for the dense parameters, local experts reduced over ``edp`` by hand; evaluation
    on a gathered replica; full-state checkpoints (same strategy and ranks to resume)."""

    distributed_checkpoint = False

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 replica: EvalReplica, experts_mesh: DeviceMesh, world_size: int,
                 traffic: Traffic, expert_fsdp: bool = False) -> None:
        super().__init__(model, optimizer)
        self.replica, self.world_size, self.traffic = replica, world_size, traffic
        self.expert_fsdp = expert_fsdp
        self.ep_group = experts_mesh.get_group("ep")
        self.edp_group = experts_mesh.get_group("edp")
        self.backwards = 0
        """Training backwards since this engine was built (the traffic counter's span)."""

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)
        if mode:
            self.replica.release()
        else:
            self.replica.fill(lambda: self._full_model_state(cpu=False))

    def predict(self, batch: Any) -> Any:
        return self.replica(batch)

    def backward(self, loss: Tensor) -> None:
        loss.backward()
        self.backwards += 1
        if not self.expert_fsdp:  # FSDP reduce-scatters sharded experts' gradients itself
            reduce_expert_grads(self.model, self.edp_group, divide_by=self.world_size)

    def summary(self) -> dict[str, Any]:
        """For ``summary.json``: the all-to-all bytes this rank sent per training step, to set
        against ``gem plan``'s ``moe_all_to_all`` (rows leaving the rank, dispatch and combine,
        forward and backward; a recomputing checkpoint policy repeats the forward's)."""
        steps = max(self.backwards, 1)
        return {"all_to_all_bytes_per_step": self.traffic.bytes_remote / steps,
                "all_to_all_bytes_per_step_including_self": self.traffic.bytes_total / steps,
                "steps_counted": self.backwards}

    def clip_grad_norm(self, max_norm: float) -> Tensor:
        experts = {id(p) for p in expert_parameters(self.model)}
        params = clipped_parameters(self.model, self.optimizer)
        dense = [p.grad for p in params if id(p) not in experts]
        squares = torch.zeros((), dtype=torch.float64)
        if dense:
            norm = torch.nn.utils.get_total_norm(dense)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            squares += float(norm) ** 2
        local = torch.zeros((), dtype=torch.float64, device=params[0].device if params else None)
        for p in params:
            if id(p) in experts:
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                local += grad.double().pow(2).sum()
        # Experts are disjoint within an ep group and equal across its copies; with
        # expert_fsdp every rank holds a disjoint shard of its copy: sum over all ranks.
        dist.all_reduce(local, group=None if self.expert_fsdp else self.ep_group)
        total = (squares + local.cpu()).sqrt().float()
        scale_to_max_norm(params, max_norm, total)
        return total

    def _full_model_state(self, *, cpu: bool = True) -> dict[str, Tensor]:
        """Full weights under the single process's names (collectives on every rank)."""
        options = _FULL if cpu else StateDictOptions(full_state_dict=True)
        state = dict(get_model_state_dict(self.model, options=options))
        experts = gather_expert_state(self.model, self.ep_group)
        device = next(iter(state.values())).device if (state and not cpu) else "cpu"
        state.update({k: v.to(device) for k, v in experts.items()})
        return state

    def state_dict(self) -> dict[str, Any]:
        """Full weights, and every rank's own optimizer state (DTensor moments as their local
        shards) in rank order. Collectives: every rank calls it."""
        model = self._full_model_state()
        local = local_cpu_copy(self.optimizer.state_dict())
        partitions: list[Any] = [None] * self.world_size
        dist.all_gather_object(partitions, local)
        return {"model": model, "optimizer": {"per_rank": partitions}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        full = state["model"]
        expert_keys = set()
        ep_rank, ep_size = dist.get_rank(self.ep_group), dist.get_world_size(self.ep_group)
        for name, layer in moe_layers(self.model):
            local = layer.num_experts // ep_size
            for pname, param in layer.experts.named_parameters(recurse=False):
                key = f"{name}.experts.{pname}"
                expert_keys.add(key)
                value = full[key][ep_rank * local:(ep_rank + 1) * local]
                if isinstance(param, DTensor):  # expert_fsdp: this rank's shard of the slice
                    value = distribute_tensor(value.to(param.device), param.device_mesh,
                                              param.placements, src_data_rank=None).to_local()
                    target = param.to_local()
                else:
                    target = param
                with torch.no_grad():
                    target.copy_(value)
        dense = {k: v for k, v in full.items() if k not in expert_keys}
        set_model_state_dict(self.model, dense,
                             options=StateDictOptions(full_state_dict=True, strict=False))
        saved = state["optimizer"]["per_rank"][dist.get_rank()]
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        for index, entry in saved["state"].items():
            param = params[index]
            for key, value in entry.items():
                if isinstance(param, DTensor) and torch.is_tensor(value) and value.dim():
                    value = value.to(param.device)
                    # AdamW's moments have the parameter's shape; row-wise tables' momentum1
                    # one value per row, placed as the table optimizer places it.
                    entry[key] = (DTensor.from_local(value, param.device_mesh, param.placements,
                                                     shape=param.shape, stride=param.stride())
                                  if value.dim() == param.dim() else row_state(value, param))
        self.optimizer.load_state_dict(saved)
