"""Evaluation on the held-out split, shared across ranks, metrics from all predictions."""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import torch

from gem_core.distributed import ParallelContext, all_gather_tensors
from gem_core.metrics import task_report

if TYPE_CHECKING:
    from gem_core.batch import JaggedBatch


@torch.no_grad()
def evaluate(engine, batches: Iterable[JaggedBatch], tasks: Sequence[str], ctx: ParallelContext,
             *, precision) -> dict[str, Any]:
    """NE, AUC, calibration and (when the data names users) GAUC per task over ``batches`` (the
    whole eval split, or a time window), per impression; every rank is given the same batches.

    Rank ``r`` computes eval batches ``r, r + W, ...``; predictions are gathered so every sample
    counts exactly once, whatever the number of ranks.
    """
    logits: dict[str, list[torch.Tensor]] = {t: [] for t in tasks}
    labels: dict[str, list[torch.Tensor]] = {t: [] for t in tasks}
    users: list[torch.Tensor] = []
    for index, batch in enumerate(batches):
        if index % ctx.world_size != ctx.rank:
            continue
        batch = batch.to(ctx.device)
        with precision.autocast(ctx.device.type):
            out = engine.predict(batch)
        for task in tasks:
            logits[task].append(out[task].float().cpu())
            labels[task].append(batch.labels[task].cpu())
        if batch.user_ids is not None:  # the user of every impression, for GAUC
            users.append(batch.user_ids[batch.candidate_rows()].cpu())
    report: dict[str, Any] = {}
    # Every rank joins the gather, also one that had no eval batch (fewer batches than ranks):
    # the collectives must match.
    local_users = torch.cat(users) if users else torch.zeros(0, dtype=torch.int64)
    groups = torch.cat(all_gather_tensors(local_users, ctx))
    for task in tasks:
        local_logits = torch.cat(logits[task]) if logits[task] else torch.zeros(0)
        local_labels = torch.cat(labels[task]) if labels[task] else torch.zeros(0)
        all_logits = torch.cat(all_gather_tensors(local_logits, ctx))
        all_labels = torch.cat(all_gather_tensors(local_labels, ctx))
        # GAUC only when every impression names its user (a source may carry no user ids).
        named = groups.numel() == all_labels.numel() > 0
        report[task] = task_report(all_logits, all_labels, groups if named else None)
    return report


def selection_ne(entry: Mapping[str, Any], tasks: Sequence[str]) -> float | None:
    """The figure a run's checkpoints are ranked by (lower is better): the mean evaluation NE
    over ``tasks`` of one ``eval_history`` entry (:data:`gem_core.checkpoint.retention.BEST_BY`).
    The trainer records it in each checkpoint's ``info.json``, so keep-best retention, the best
    checkpoint readers load by default, early stopping and the overfitting warning all rank by
    this one figure. None when a task's NE is undefined (one class in the eval set)."""
    values = [entry.get(task, {}).get("ne") for task in tasks]
    if not values or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
        return None
    return statistics.fmean(values)
