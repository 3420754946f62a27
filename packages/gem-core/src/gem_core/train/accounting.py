"""The trainer's accounting: each step's figures summed over ranks in one reduction, the running
totals a checkpoint keeps, each step's record (a ``metrics.jsonl`` line, what the progress bar
shows) and the part of ``summary.json`` computed from them."""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import attrs
import torch

from gem_core.batch import JaggedBatch
from gem_core.contracts import RankingModel
from gem_core.distributed import ParallelContext, all_reduce_max, all_reduce_sum
from gem_core.train.summary import performance


@attrs.frozen(kw_only=True)
class ReducedStep:
    """One step's figures, summed over ranks (``busiest_tokens``: the most of any rank's)."""

    task_loss: list[float]
    """Per task, its loss summed over the global batch's impressions, divided by their number."""

    model_loss: Mapping[str, float] = attrs.field(factory=dict)
    """The model's per-impression losses (:meth:`RankingModel.impression_loss_sums`), each
    summed over the global batch's impressions and divided by their number; not in ``loss``."""

    impressions: float
    """Samples: the candidates of the global batch's requests, each with its labels."""

    requests: float
    """Requests: one history with its candidates, encoded once."""

    tokens: float
    """History events."""

    flops: Mapping[str, float]
    """Training FLOPs (:meth:`RankingModel.flops`): ``total``, ``attention``, ``padded_total``,
    ``padded_attention``."""

    busiest_tokens: float
    """The most tokens any rank had."""

    nonfinite_grad: bool
    """Some rank's gradient norm was NaN or Inf."""

    stop: bool
    """Some rank was asked to stop (a signal)."""

    @property
    def loss(self) -> float:
        return sum(self.task_loss)


class RunAccounting:
    """What the run's steps trained on and how fast. ``totals`` (kept in checkpoints) sum every
    step since the run began; ``step_times`` hold only the steps of this invocation (a resumed
    run times its own)."""

    def __init__(self, tasks: Sequence[str], ctx: ParallelContext) -> None:
        self.tasks, self.ctx = tuple(tasks), ctx
        self.totals: dict[str, float] = {
            "samples": 0, "requests": 0, "tokens": 0, "flops": 0.0, "attention_flops": 0.0,
            "padded_flops": 0.0, "padded_attention_flops": 0.0}
        self.step_times: list[float] = []

    def reduce(self, batch: JaggedBatch, model: RankingModel, task_sums: torch.Tensor, *,
               impressions: float, grad_norm: float, stop_requested: float,
               model_sums: Mapping[str, torch.Tensor] | None = None) -> ReducedStep:
        """This rank's step (``task_sums``: its loss sums per task; ``model_sums``: the model's
        per-impression loss sums; ``impressions``: the global batch's, already summed) summed
        over ranks."""
        flops = model.flops(batch.seq_lengths().cpu(), batch.candidate_counts().cpu())
        names = sorted(model_sums or {})
        # The model's and the tasks' loss sums leave the device together: one sync, not one each.
        losses = torch.cat([*(model_sums[name].detach().double().reshape(1) for name in names),
                            task_sums.detach().double().reshape(-1)]).cpu().tolist()
        local = torch.tensor([*losses, batch.batch_size,
                              batch.num_events, flops["total"], flops["attention"],
                              flops["padded_total"], flops["padded_attention"],
                              0.0 if math.isfinite(grad_norm) else 1.0, stop_requested],
                             dtype=torch.float64)
        # One reduction gives every rank the same loss and the same "any rank non-finite" and
        # "any rank asked to stop" flags, so all ranks take or skip the step, or stop, together.
        reduced = all_reduce_sum(local, self.ctx).tolist()
        model_loss = {name: x / max(impressions, 1.0) for name, x in zip(names, reduced)}
        reduced = reduced[len(names):]
        num_tasks = len(self.tasks)
        (requests, tokens, total, attention, padded, padded_attention, bad,
         stops) = reduced[num_tasks:]
        busiest = all_reduce_max(torch.tensor([float(batch.num_events)]), self.ctx).item()
        return ReducedStep(
            task_loss=[x / max(impressions, 1.0) for x in reduced[:num_tasks]],
            model_loss=model_loss,
            impressions=impressions, requests=requests, tokens=tokens,
            flops={"total": total, "attention": attention, "padded_total": padded,
                   "padded_attention": padded_attention},
            busiest_tokens=busiest, nonfinite_grad=bad > 0, stop=stops > 0)

    def step_record(self, step: int, reduced: ReducedStep, *, step_time: float, peak: float,
                    trainer_figures: Mapping[str, Any], model: RankingModel,
                    aux_losses: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Add step ``step`` to the totals and return its record: loss, totals, throughput,
        ``trainer_figures`` (learning rates, gradient norm, compile time), FLOPs, MFU against
        ``peak`` FLOP/s, then the model's own figures (:meth:`model_step_stats`)."""
        flops, world_size = reduced.flops, self.ctx.world_size
        samples, requests, tokens = reduced.impressions, reduced.requests, reduced.tokens
        self.totals["samples"] += int(samples)
        self.totals["requests"] += int(requests)
        self.totals["tokens"] += int(tokens)
        self.totals["flops"] += flops["total"]
        self.totals["attention_flops"] += flops["attention"]
        self.totals["padded_flops"] += flops["padded_total"]
        self.totals["padded_attention_flops"] += flops["padded_attention"]
        self.step_times.append(step_time)
        record = {
            "step": step,
            "loss": reduced.loss,
            **{f"loss_{t}": v for t, v in zip(self.tasks, reduced.task_loss)},
            **{f"{name}_loss": v for name, v in reduced.model_loss.items()},
            # A sample is an impression (a candidate of a request, with its labels); a request
            # is one history with its candidates, encoded once.
            "samples": self.totals["samples"],
            "requests": self.totals["requests"],
            "tokens": self.totals["tokens"],
            "step_time_s": step_time,
            "samples_per_s": samples / step_time,
            "requests_per_s": requests / step_time,
            "tokens_per_s": tokens / step_time,
            **trainer_figures,
            "flops": flops["total"],
            "padded_flops": flops["padded_total"],
            "attention_flops": flops["attention"],
            "padded_attention_flops": flops["padded_attention"],
            "mfu": flops["total"] / (world_size * step_time * peak),
            # A straggler shows as a rank with more tokens than the mean.
            "rank_tokens_max_over_mean": (reduced.busiest_tokens / (tokens / world_size)
                                          if tokens else 1.0),
        }
        record.update(self.model_step_stats(model, aux_losses))
        return record

    def model_step_stats(self, model: RankingModel,
                         aux_losses: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """The model's own figures of this step (MoE tokens per expert, load balance, dropped
        tokens, auxiliary loss), summed over ranks; empty when the model reports none."""
        stats = dict(model.step_stats())
        if aux_losses:
            stats["aux_loss"] = float(sum(loss.detach() for loss in aux_losses.values()))
        if not stats:
            return {}
        keys = sorted(stats)
        values = all_reduce_sum(torch.tensor([stats[k] for k in keys], dtype=torch.float64),
                                self.ctx).tolist()
        summed = dict(zip(keys, values))
        record = dict(model.summarize_step_stats(summed))
        if "aux_loss" in summed:
            record["aux_loss"] = summed["aux_loss"] / self.ctx.world_size
        if "moe_dropped_tokens" in record:
            self.totals["moe_dropped_tokens"] = (self.totals.get("moe_dropped_tokens", 0.0)
                                                 + record["moe_dropped_tokens"])
        return record

    def summary(self, *, steps: int, peak: float, guard: Mapping[str, Any]) -> dict[str, Any]:
        """``summary.json``'s performance figures (:func:`performance`) of a run at step
        ``steps``, the ``guard``'s report of skipped steps and MoE's dropped tokens."""
        return {
            **performance(self.totals, steps=steps, step_times=self.step_times,
                          world_size=self.ctx.world_size, peak=peak,
                          device_type=self.ctx.device.type),
            "guard": guard,
            **({"moe": {"dropped_tokens": self.totals["moe_dropped_tokens"]}}
               if "moe_dropped_tokens" in self.totals else {}),
        }
