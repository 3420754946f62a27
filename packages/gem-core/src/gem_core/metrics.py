"""Quality metrics of binary tasks: NE, AUC, calibration (computed in float64)."""

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


def calibration(logits: Tensor, labels: Tensor) -> float:
    """Mean predicted probability over observed positive rate (1.0 is perfectly calibrated)."""
    rate = labels.double().mean().item()
    if rate <= 0:
        return math.nan
    return torch.sigmoid(logits.double()).mean().item() / rate


def task_report(logits: Tensor, labels: Tensor) -> dict[str, float]:
    return {
        "ne": normalized_entropy(logits, labels),
        "auc": roc_auc(logits, labels),
        "calibration": calibration(logits, labels),
        "log_loss": torch.nn.functional.binary_cross_entropy_with_logits(
            logits.double(), labels.double()).item(),
        "positive_rate": labels.double().mean().item(),
        "samples": labels.numel(),
    }
