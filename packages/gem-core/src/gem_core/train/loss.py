"""The multi-task objective: binary cross-entropy per task, computed in float32."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from gem_core.batch import JaggedBatch


def task_loss_sums(logits: Mapping[str, Tensor], batch: JaggedBatch,
                   tasks: Sequence[str]) -> Tensor:
    """``(num_tasks,)`` sums over the batch's impressions of each task's BCE (float32 whatever
    the autocast)."""
    return torch.stack([
        F.binary_cross_entropy_with_logits(logits[t].float(), batch.labels[t], reduction="sum")
        for t in tasks
    ])


def mean_loss(logits: Mapping[str, Tensor], batch: JaggedBatch, tasks: Sequence[str]) -> Tensor:
    """Sum over tasks of the per-impression mean BCE: the loss a calibration pass looks at."""
    return task_loss_sums(logits, batch, tasks).sum() / max(batch.num_candidates, 1)
