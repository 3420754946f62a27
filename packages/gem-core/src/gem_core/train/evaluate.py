"""Evaluation on the held-out split, shared across ranks, metrics from all predictions."""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import torch

from gem_core.distributed import ParallelContext, all_gather_tensors
from gem_core.errors import GemConfigError
from gem_core.ids import splitmix64, unsigned_mod
from gem_core.metrics import task_report

if TYPE_CHECKING:
    from gem_core.batch import JaggedBatch


VALIDATION = "validation"
"""The key of an evaluation's validation part (``train.validation_share``) in its report and in
``eval_history`` entries, beside the tasks' reports of the rest (the reported part)."""

VALIDATION_BUCKETS = 1 << 20
"""Resolution of ``train.validation_share``: a key is in the validation part when its hash
modulo this falls below ``share x`` this."""


def in_validation(keys: torch.Tensor, share: float) -> torch.Tensor:
    """Which of the int64 ``keys`` (user ids, or request keys) fall in the validation part of
    ``share``: a hash of the key, so a user's impressions all land on one side, the same at
    every evaluation, on every number of ranks and in every run on the same data."""
    return unsigned_mod(splitmix64(keys), VALIDATION_BUCKETS) < round(share * VALIDATION_BUCKETS)


def _part_keys(batch: JaggedBatch, index: int) -> torch.Tensor:
    """The key of each impression of eval batch ``index`` that decides its part: its user, or
    where the data names none its request (the batch's index and the request's row in it, the
    same whatever the number of ranks)."""
    rows = batch.candidate_rows()
    if batch.user_ids is not None:
        return batch.user_ids[rows].to(torch.int64).cpu()
    return (index << 32) + rows.to(torch.int64).cpu()


def check_validation_parts(batches: Iterable[JaggedBatch], share: float) -> str:
    """Divide the eval split ``batches`` as :func:`evaluate` will with ``validation_share =
    share`` (keys only, no model) and say how, for the start-up log; a ``GemConfigError`` when
    either part would be empty, before any step is trained."""
    keys, by_user = [], True
    for index, batch in enumerate(batches):
        keys.append(_part_keys(batch, index))
        by_user = by_user and batch.user_ids is not None
    every = torch.cat(keys) if keys else torch.zeros(0, dtype=torch.int64)
    held = int(in_validation(every, share).sum())
    rest = every.numel() - held
    _refuse_an_empty_part(share, held, every.numel())
    return (f"train.validation_share = {share}: checkpoints are ranked on {held} of the eval "
            f"split's {every.numel()} impressions (divided by a hash of their "
            f"{'users' if by_user else 'requests'}); evaluations report the other {rest}")


def _refuse_an_empty_part(share: float, held: int, total: int) -> None:
    """A ``GemConfigError`` when ``held`` of ``total`` eval impressions in the validation part
    leave either part empty."""
    if held and held < total:
        return
    raise GemConfigError(
        f"train.validation_share = {share} leaves the {'reported' if held else 'validation'} "
        f"part of the eval split empty ({held} of {total} impressions in validation): evaluate "
        "on more requests (data.eval_rows) or choose another share")


@torch.no_grad()
def evaluate(engine, batches: Iterable[JaggedBatch], tasks: Sequence[str], ctx: ParallelContext,
             *, precision, validation_share: float = 0.0) -> dict[str, Any]:
    """NE, AUC, calibration and (when the data names users) GAUC per task over ``batches`` (the
    whole eval split, or a time window), per impression; every rank is given the same batches.

    Rank ``r`` computes eval batches ``r, r + W, ...``; predictions are gathered so every sample
    counts exactly once, whatever the number of ranks.

    With ``validation_share > 0`` the impressions are divided by a hash of their user (of their
    request where the data names no users; :func:`in_validation`): the tasks' reports are of
    the rest, and ``report[VALIDATION]`` holds the tasks' reports of that share, the figures
    checkpoints are ranked by (:func:`selection_ne`), so that the reported figures are not
    those the best checkpoint was picked on. Raises ``GemConfigError`` when either part is
    empty.
    """
    logits: dict[str, list[torch.Tensor]] = {t: [] for t in tasks}
    labels: dict[str, list[torch.Tensor]] = {t: [] for t in tasks}
    users: list[torch.Tensor] = []
    part_keys: list[torch.Tensor] = []
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
        if validation_share:
            part_keys.append(_part_keys(batch, index))
    # Every rank joins the gather, also one that had no eval batch (fewer batches than ranks):
    # the collectives must match.
    local_users = torch.cat(users) if users else torch.zeros(0, dtype=torch.int64)
    groups = torch.cat(all_gather_tensors(local_users, ctx))
    gathered: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for task in tasks:
        local_logits = torch.cat(logits[task]) if logits[task] else torch.zeros(0)
        local_labels = torch.cat(labels[task]) if labels[task] else torch.zeros(0)
        gathered[task] = (torch.cat(all_gather_tensors(local_logits, ctx)),
                          torch.cat(all_gather_tensors(local_labels, ctx)))
    if not validation_share:
        return _reports(gathered, groups, None)
    local_keys = torch.cat(part_keys) if part_keys else torch.zeros(0, dtype=torch.int64)
    validation = in_validation(torch.cat(all_gather_tensors(local_keys, ctx)), validation_share)
    _refuse_an_empty_part(validation_share, int(validation.sum()), validation.numel())
    return {**_reports(gathered, groups, ~validation),
            VALIDATION: _reports(gathered, groups, validation)}


def _reports(gathered: Mapping[str, tuple[torch.Tensor, torch.Tensor]], groups: torch.Tensor,
             keep: torch.Tensor | None) -> dict[str, Any]:
    """Each task's report over its gathered ``(logits, labels)``, of the impressions ``keep``
    (None: all)."""
    report: dict[str, Any] = {}
    for task, (logits, labels) in gathered.items():
        # GAUC only when every impression names its user (a source may carry no user ids).
        named = groups.numel() == labels.numel() > 0
        task_groups = groups if named else None
        if keep is not None:
            logits, labels = logits[keep], labels[keep]
            task_groups = task_groups[keep] if task_groups is not None else None
        report[task] = task_report(logits, labels, task_groups)
    return report


def selection_ne(entry: Mapping[str, Any], tasks: Sequence[str]) -> float | None:
    """The figure a run's checkpoints are ranked by (lower is better): the mean evaluation NE
    over ``tasks`` of one ``eval_history`` entry (:data:`gem_core.checkpoint.retention.BEST_BY`).
    The trainer records it in each checkpoint's ``info.json``, so keep-best retention, the best
    checkpoint readers load by default, early stopping and the overfitting warning all rank by
    this one figure: that of the entry's validation part where it has one
    (``train.validation_share``), else of the evaluation it reports. None when a task's NE is
    undefined (one class in the eval set)."""
    entry = entry.get(VALIDATION, entry)
    values = [entry.get(task, {}).get("ne") for task in tasks]
    if not values or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
        return None
    return statistics.fmean(values)
