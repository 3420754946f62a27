"""``deepspeed-zero1|2|3``: DeepSpeed ZeRO over the process group torchrun started (or, for one
process, a one-rank group of :func:`gem_core.distributed.single_process_group`, which
``deepspeed.initialize`` adopts instead of looking for a launcher's environment).

DeepSpeed owns the optimizer step: it wraps the AdamW that ``make_optimizer`` builds (same
parameter groups as every other strategy) in its ZeRO optimizer, which partitions optimizer
state (stage 1), gradients too (stage 2) or parameters too (stage 3) across the ranks.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from gem_core.contracts import DenseSharding
from gem_core.distributed import ParallelContext, single_process_group
from gem_core.engine import Engine, local_cpu_copy
from gem_core.plan_estimate import Estimate, PlanFacts, adam_memory, ring_fraction
from gem_parallel.eval_replica import EvalReplica


def deepspeed_config(stage: int, *, world_size: int, bf16: bool) -> dict[str, Any]:
    """The DeepSpeed config: ZeRO ``stage``, one micro-batch per step (the trainer forms the
    batches and scales the loss itself), bf16 when the precision recipe computes in it."""
    return {
        # DeepSpeed insists on a batch size; the trainer does its own batching, so these only
        # make DeepSpeed treat every backward as an accumulation boundary.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": bf16},
        # The trainer's AdamW (torch) is not one of DeepSpeed's tested optimizers.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def destroy_with_deepspeed() -> None:
    """Destroy the process group through DeepSpeed, which then drops its cached groups
    (expert, data-parallel, world clones): a later run in the same process would otherwise get
    groups of the destroyed one ("Group ... is not registered"). When DeepSpeed never adopted
    the group (the run stopped before ``deepspeed.initialize``), torch destroys it."""
    import deepspeed.comm

    if deepspeed.comm.is_initialized():
        deepspeed.comm.destroy_process_group()
    else:
        dist.destroy_process_group()


def local_rank_for_deepspeed(ctx: ParallelContext) -> None:
    """DeepSpeed reads ``LOCAL_RANK`` (its launcher and torchrun set it) in
    ``deepspeed.initialize`` and, under ZeRO-3, again in every forward; a one-process run
    started without a launcher has none. Set it to this process's local rank for the rest of the
    process (nothing else reads it after start-up)."""
    if "LOCAL_RANK" not in os.environ and "OMPI_COMM_WORLD_LOCAL_RANK" not in os.environ:
        os.environ["LOCAL_RANK"] = str(ctx.local_rank)


#: What DeepSpeed's ZeRO optimizer puts into its state dict besides tensors and plain data
#: (checked on ZeRO-1 of deepspeed 0.19.8: loss scaler, stage enum, parameter fragments): the
#: classes a DeepSpeed engine's ``engine.pt`` may hold.
DEEPSPEED_CHECKPOINT_CLASSES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


class DeepSpeedZeroStrategy(DenseSharding):
    checkpoint_classes = DEEPSPEED_CHECKPOINT_CLASSES

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self.name = f"deepspeed-zero{stage}"

    def apply(self, model: nn.Module, *, ctx: ParallelContext, make_optimizer: Callable,
              precision, options) -> Engine:
        bf16 = precision.compute_dtype == "bfloat16"
        if precision.compute_dtype not in ("float32", "bfloat16"):
            raise RuntimeError(
                f"dense_sharding {self.name!r} supports float32 and bfloat16 recipes; "
                f"{precision.name!r} computes in {precision.compute_dtype}"
            )
        if not ctx.is_distributed:
            # One process: ZeRO over a group of one rank (nothing to partition, the same
            # engine and checkpoints), so a DeepSpeed setup can be tried on a laptop.
            single_process_group(ctx, destroy=destroy_with_deepspeed)
        import deepspeed

        # Stage 3 partitions the parameters inside the module itself, so evaluation needs a
        # separate replica (see eval_replica); stages 1-2 keep full parameters on every rank.
        replica = EvalReplica(model) if self.stage == 3 else None
        local_rank_for_deepspeed(ctx)
        ds_engine, ds_optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=make_optimizer(model),
            config=deepspeed_config(self.stage, world_size=ctx.world_size, bf16=bf16),
        )
        return DeepSpeedEngine(ds_engine, ds_optimizer, unwrapped=model, replica=replica,
                               partitions_parameters=self.stage == 3)

    def plan_estimate(self, facts: PlanFacts, options) -> Estimate:
        return zero_estimate(self.stage, facts.dense_parameters, facts.world_size)


def zero_estimate(stage: int, parameters: float, ranks: int) -> Estimate:
    """ZeRO ``stage`` over ``ranks``: moments partitioned from stage 1, gradients from stage 2,
    parameters at stage 3; stage 3 all-gathers parameters in the forward and the backward and
    reduce-scatters gradients, stages 1-2 reduce-scatter gradients and all-gather the updated
    parameters, stage 0 all-reduces gradients (the same bytes)."""
    size = parameters * 4
    factor = 3 if stage == 3 else 2
    return Estimate(
        memory=adam_memory("dense", parameters, params_over=ranks if stage == 3 else 1,
                           grads_over=ranks if stage >= 2 else 1,
                           optimizer_over=ranks if stage >= 1 else 1),
        communication={"dense": factor * ring_fraction(ranks) * size if ranks > 1 else 0})


class DeepSpeedEngine(Engine):
    """Backward, clipping, step and full state dicts through the DeepSpeed engine.

    Checkpoints keep the full-state path (``distributed_checkpoint = False``): the ZeRO
    optimizer's flat fp32 partitions are not parameters that torch.distributed.checkpoint's
    state-dict helpers can name, so rank 0 writes the full weights and every rank's optimizer
    partitions, and a resume needs the same strategy and number of ranks (the trainer checks).
    """

    distributed_checkpoint = False

    def __init__(self, ds_engine, optimizer, *, unwrapped: nn.Module,
                 replica: EvalReplica | None, partitions_parameters: bool = False) -> None:
        super().__init__(ds_engine, optimizer, unwrapped=unwrapped)
        self.ds = ds_engine
        self.replica = replica
        self.partitions_parameters = partitions_parameters
        """ZeRO-3: the module's parameters are partitioned (DeepSpeed restores them itself)."""

    def _named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.unwrapped.named_parameters() if p.requires_grad]

    def train(self, mode: bool = True) -> None:
        self.ds.train(mode)
        if self.replica is None:
            return
        if mode:
            self.replica.release()
        else:
            # Every rank enters evaluation together: the one moment a gather is safe.
            self.replica.fill(self._full_model_state)

    def predict(self, batch: Any) -> Any:
        if self.replica is not None:
            return self.replica(batch)
        # Stages 1-2: the module holds every parameter; calling it directly runs no collective.
        return self.unwrapped(batch)

    def backward(self, loss: torch.Tensor) -> None:
        self.ds.backward(loss)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm, from DeepSpeed's full (reduced, fp32) gradients. DeepSpeed
        clips inside ``step()`` with the same norm; ``max_norm`` is handed to it here because
        the trainer's clip value is known only now."""
        from deepspeed.utils import safe_get_full_grad

        self.ds.optimizer.clip_grad = max_norm
        squares = torch.zeros((), dtype=torch.float64)
        for _, param in self._named_parameters():
            grad = safe_get_full_grad(param)  # a collective: every rank, same order
            if grad is not None:
                squares += grad.double().pow(2).sum().cpu()
        return squares.sqrt().float()

    def step(self) -> None:
        self.ds.step()

    def zero_grad(self) -> None:
        """Discarding a step's gradients (the trainer does it to skip a non-finite step) is not
        possible from outside: after the backward DeepSpeed already holds them reduced in its
        ZeRO partitions, and only its own ``step()`` consumes and clears them. Fail loudly
        rather than let them leak into the next step."""
        raise RuntimeError(
            "deepspeed-zero engines cannot skip an optimizer step: the reduced gradients live "
            "in DeepSpeed's ZeRO partitions until its step(). Lower the learning rate or use "
            "the fsdp2 dense sharding (or another that is not DeepSpeed's) for runs that need "
            "step skipping"
        )

    def set_lr(self, lr: float) -> None:
        for group in self.ds.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)

    def _full_model_state(self) -> dict[str, torch.Tensor]:
        from deepspeed.utils import safe_get_full_fp32_param

        full = {name: safe_get_full_fp32_param(param).detach().cpu()
                for name, param in self._named_parameters()}
        # Buffers are never partitioned; they are in the module's own state dict.
        return {**{k: v.cpu() for k, v in self.unwrapped.state_dict().items()
                   if k not in full and k in dict(self.unwrapped.named_buffers())}, **full}

    def state_dict(self) -> dict[str, Any]:
        """Full fp32 weights by parameter name, and the ZeRO optimizer's partitions of every
        rank (its fp32 master partition and AdamW moments), in rank order. Collectives: every
        rank calls it. Resuming needs the same number of ranks (the trainer checks that)."""
        partitions: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(partitions, local_cpu_copy(self.ds.optimizer.state_dict()))
        return {"model": self._full_model_state(), "optimizer": {"zero_partitions": partitions}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # The fp32 masters come from the optimizer partitions. Stage 3 then refreshes the
        # module's partitioned parameters from them; stages 1-2 do not (DeepSpeed's own
        # load_checkpoint loads the module's weights separately), so the first resumed step
        # would run on the weights of initialisation: copy the full weights in. The module's
        # parameters are views of DeepSpeed's flat buffers, so an in-place copy updates those.
        self.ds.optimizer.load_state_dict(state["optimizer"]["zero_partitions"],
                                          load_optimizer_states=True,
                                          load_from_fp32_weights=True)
        with torch.no_grad():
            if not self.partitions_parameters:  # stages 0-2: the module holds every parameter
                self._load_module_weights(state["model"])
            for name, buffer in self.unwrapped.named_buffers():
                if name in state["model"]:
                    buffer.copy_(state["model"][name])

    def _load_module_weights(self, full: dict[str, torch.Tensor]) -> None:
        for name, param in self._named_parameters():
            param.copy_(full[name])
