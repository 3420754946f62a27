"""The parts of ``summary.json`` computed from what a run did, measured and evaluated: the run
(how far it got, why it stopped), the performance figures (throughput, FLOPs, padding saved,
MFU) and the evaluations, led by the headline one with the checkpoint it belongs to. The trainer
adds what its components report."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Mapping, Sequence

from gem_core.config import GemConfig
from gem_core.distributed import ParallelContext
from gem_core.train.evaluate import VALIDATION
from gem_core.train.time_order import TimeOrder

WARMUP_STEPS_EXCLUDED = 3
"""The first steps pay one-off costs (allocation, compilation); throughput figures leave them
out."""


def run_record(config: GemConfig, ctx: ParallelContext, *, step: int, resumed_from: int,
               ending: Mapping[str, str] | None, data_passes: int | None,
               wall_s: float) -> dict[str, Any]:
    """``summary.json``'s ``run``: how far it got and why it stopped there (``ending``: why it
    ended before ``train.steps``, or None)."""
    steps = config.train.steps
    return {"name": config.name, "steps": step, "resumed_from": resumed_from,
            "finished": step >= steps or ending is not None,
            "stopped": ending or {
                "reason": "steps" if step >= steps else "until_step",
                "message": f"stopped at step {step} (train.steps = {steps})"},
            "data_passes": data_passes,
            "world_size": ctx.world_size, "nodes": ctx.num_nodes,
            "device": str(ctx.device), "wall_time_s": wall_s}


def performance(totals: Mapping[str, float], *, steps: int, step_times: Sequence[float],
                world_size: int, peak: float, device_type: str) -> dict[str, Any]:
    """``throughput``, ``flops``, ``padding_saved`` and ``mfu`` of a run that trained ``steps``
    steps (this part of it) with these ``totals`` and per-step times, on devices of ``peak``
    FLOP/s."""
    timed = list(step_times[WARMUP_STEPS_EXCLUDED:]) or list(step_times)
    median_step = statistics.median(timed) if timed else float("nan")
    steps = max(steps, 1)
    t = totals
    flops_per_step = t["flops"] / steps
    local_mfu = flops_per_step / (world_size * median_step * peak) if timed else None
    scaling = 1.0 if world_size == 1 else None
    return {
        "throughput": {
            "step_time_s_median": median_step,
            # impressions (samples) and requests per second at the median step
            "samples_per_s": (t["samples"] / steps) / median_step,
            "impressions_per_s": (t["samples"] / steps) / median_step,
            "requests_per_s": (t["requests"] / steps) / median_step,
            "tokens_per_s": (t["tokens"] / steps) / median_step,
            "steps_timed": len(timed),
        },
        "flops": {"per_step": flops_per_step,
                  "attention_per_step": t["attention_flops"] / steps,
                  "padded_per_step": t["padded_flops"] / steps,
                  "counting": "3 x forward multiply-adds x 2 over the real jagged lengths"},
        "padding_saved": {
            "total": 1 - t["flops"] / t["padded_flops"] if t["padded_flops"] else 0.0,
            "attention": (1 - t["attention_flops"] / t["padded_attention_flops"]
                          if t["padded_attention_flops"] else 0.0),
        },
        "mfu": {
            "local": local_mfu, "peak_flops_per_device": peak,
            "peak_source": f"measured dense matmul on {device_type}",
            "scaling_ratio": scaling,
            "scaling_ratio_source": ("single process" if scaling is not None else
                                     "not measured in this run (gem bench scaling)"),
            "e2e": local_mfu * scaling if (local_mfu is not None and scaling) else None,
        },
    }


def headline(run_dir: Path, history: Sequence[Mapping[str, Any]], *, step: int,
             time_order: TimeOrder | None) -> tuple[Mapping[str, Any], dict[str, Any]]:
    """The evaluation the summary leads with and the checkpoint it belongs to (which, and why).

    Epochs: that of the checkpoint readers use by default (:func:`choose_checkpoint`: the best),
    or the last evaluation when that one is not known here. Time order: the mean of the windows'
    evaluations, and the newest checkpoint, trained on the most recent window."""
    from gem_core.trained_run import choose_checkpoint  # it imports the train package

    if time_order is not None:
        mean = time_order.mean([e for e in history if "window" in e])
        return mean, {"step": step, "best": False,
                      "reason": f"time order: the newest checkpoint, step {step}, trained on "
                                "the most recent window"}
    try:
        choice = choose_checkpoint(run_dir)
    except Exception:  # noqa: BLE001 - no checkpoint here (another rank's files): the last
        choice = None
    entries = [e for e in history if choice is not None and e["step"] == choice.step]
    if not entries:
        last = history[-1]
        return last, {"step": last["step"], "best": False,
                      "reason": f"the last evaluation, step {last['step']}"}
    return entries[-1], {"step": choice.step, "best": choice.best, "reason": choice.reason}


def evaluation_summary(run_dir: Path, history: Sequence[Mapping[str, Any]],
                       tasks: Sequence[str], *, step: int, time_order: TimeOrder | None,
                       windows_trained: int | None) -> dict[str, Any]:
    """``summary.json``'s ``eval`` (:func:`headline`), ``eval_last``, with
    ``train.validation_share`` ``eval_validation`` (the validation part of the headline's
    evaluation, which ranked the checkpoints), in time order ``progressive``
    (``windows_trained``: windows trained on), and ``checkpoint_used``."""
    final, used = headline(run_dir, history, step=step, time_order=time_order)
    return {
        # The headline: the evaluation of the checkpoint readers use by default (the best),
        # or in time order the windows' mean.
        "eval": {task: final[task] for task in tasks},
        "eval_last": {task: history[-1][task] for task in tasks} if history else final,
        **({"eval_validation": {task: final[VALIDATION][task] for task in tasks}}
           if VALIDATION in final else {}),
        **({"progressive": time_order.summary(history, windows_trained)}
           if time_order is not None else {}),
        "checkpoint_used": used,
    }
