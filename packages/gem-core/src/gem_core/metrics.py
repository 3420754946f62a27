"""Quality metrics of binary tasks: NE, AUC, GAUC, calibration (computed in float64)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

_EPS = 1e-12


def normalized_entropy(logits: Tensor, labels: Tensor) -> float:
    """Cross-entropy of the predictions divided by the entropy of the base rate.

    Below 1.0 means the model beats always predicting the observed positive rate. NaN when the
    labels are all 0 or all 1 (the base-rate entropy is 0).
    """
    logits, labels = logits.double(), labels.double()
    cross_entropy = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels).item()
    p = labels.mean().item()
    if p <= 0.0 or p >= 1.0:
        return math.nan
    base = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    return cross_entropy / base


def roc_auc(scores: Tensor, labels: Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney), with tied scores sharing their average rank."""
    scores, labels = scores.double().flatten(), labels.double().flatten()
    positives = labels.sum().item()
    negatives = labels.numel() - positives
    if positives == 0 or negatives == 0:
        return math.nan
    order = torch.argsort(scores)
    sorted_scores = scores[order]
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True,
                                                  return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    average_rank = ends - (counts.double() - 1) / 2  # 1-based mean rank of each tie group
    ranks = average_rank[inverse]
    rank_sum = ranks[labels[order] == 1].sum().item()
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


def grouped_auc(scores: Tensor, labels: Tensor, groups: Tensor) -> dict[str, float]:
    """GAUC: per-user AUC averaged with each user weighted by their number of impressions.

    ``groups`` holds an integer user key per impression, ``labels`` are 0/1. A user's AUC is the
    Mann-Whitney statistic over that user's impressions only, tied scores sharing their average
    rank (so a tied positive/negative pair counts 1/2, as in :func:`roc_auc`). Users whose
    impressions are all of one class have no AUC and are left out of both the sum and the
    weights. Returns::

        gauc                        sum(n_u * auc_u) / sum(n_u) over counted users (NaN if none)
        gauc_users                  users counted
        gauc_impressions            their impressions (the denominator)
        gauc_excluded_users         users with a single class
        gauc_excluded_impressions   their impressions

    Vectorised: a lexicographic sort by (group, score) (two stable argsorts), ranks from the tie
    runs, per-user sums by ``index_add`` -- no Python loop over users.
    """
    scores = scores.detach().double().flatten()
    labels = labels.detach().flatten()
    groups = groups.detach().flatten()
    if not (scores.numel() == labels.numel() == groups.numel()):
        raise ValueError(f"scores, labels and groups differ in size: {scores.numel()}, "
                         f"{labels.numel()}, {groups.numel()}")
    if groups.is_floating_point() or groups.is_complex() or groups.dtype == torch.bool:
        raise ValueError(f"groups must be an integer user key, got {groups.dtype}")
    if not ((labels == 0) | (labels == 1)).all():
        raise ValueError("grouped_auc needs 0/1 labels")
    groups = groups.long()
    positive = labels == 1
    n = scores.numel()

    # Sort by (group, score): stable sort on the secondary key, then stable sort on the primary.
    by_score = torch.argsort(scores, stable=True)
    order = by_score[torch.argsort(groups[by_score], stable=True)]
    g, s, y = groups[order], scores[order], positive[order]

    # Users: consecutive runs of g. Tie runs: consecutive runs of (g, s).
    _, user_of, user_sizes = torch.unique_consecutive(g, return_inverse=True, return_counts=True)
    user_start = torch.cumsum(user_sizes, 0) - user_sizes  # first sorted position of each user
    new_run = torch.ones(n, dtype=torch.bool, device=g.device)
    if n > 1:
        new_run[1:] = (g[1:] != g[:-1]) | (s[1:] != s[:-1])
    run_of = torch.cumsum(new_run.long(), 0) - 1
    run_sizes = torch.bincount(run_of, minlength=int(run_of[-1]) + 1 if n else 0)
    run_end = torch.cumsum(run_sizes, 0)  # one past the last sorted position of each run
    # 1-based average rank of each run inside its user (a run never spans two users).
    run_user_start = user_start[user_of[new_run]]
    run_rank = (run_end - run_user_start).double() - (run_sizes.double() - 1) / 2
    rank = run_rank[run_of]

    n_users = user_sizes.numel()
    y_double = y.double()
    pos = torch.zeros(n_users, dtype=torch.float64, device=g.device)
    pos.index_add_(0, user_of, y_double)
    pos_rank_sum = torch.zeros_like(pos).index_add_(0, user_of, rank * y_double)
    sizes = user_sizes.double()
    neg = sizes - pos
    counted = (pos > 0) & (neg > 0)
    pc, nc, rc, wc = pos[counted], neg[counted], pos_rank_sum[counted], sizes[counted]
    user_auc = (rc - pc * (pc + 1) / 2) / (pc * nc)
    weight = wc.sum().item()
    gauc = (user_auc * wc).sum().item() / weight if weight > 0 else math.nan
    users = int(counted.sum().item())
    return {
        "gauc": gauc,
        "gauc_users": users,
        "gauc_impressions": int(weight),
        "gauc_excluded_users": n_users - users,
        "gauc_excluded_impressions": n - int(weight),
    }


def calibration(logits: Tensor, labels: Tensor) -> float:
    """Mean predicted probability over observed positive rate (1.0 is perfectly calibrated)."""
    rate = labels.double().mean().item()
    if rate <= 0:
        return math.nan
    return torch.sigmoid(logits.double()).mean().item() / rate


def task_report(logits: Tensor, labels: Tensor,
                groups: Tensor | None = None) -> dict[str, float]:
    """NE, AUC, calibration, log loss; with ``groups`` (a user key per sample) also GAUC and its
    counts (see :func:`grouped_auc`)."""
    report = {
        "ne": normalized_entropy(logits, labels),
        "auc": roc_auc(logits, labels),
        "calibration": calibration(logits, labels),
        "log_loss": torch.nn.functional.binary_cross_entropy_with_logits(
            logits.double(), labels.double()).item(),
        "positive_rate": labels.double().mean().item(),
        "samples": labels.numel(),
    }
    if groups is not None:
        report.update(grouped_auc(logits, labels, groups))
    return report
