"""The Student Adapter: a small learned correction of a stale teacher's logits.

A teacher trained on an older window of a drifting world gives soft labels that describe the
past. The adapter maps the teacher's outputs (every task's logit and, optionally, its user
embedding) to corrected logits and is fitted on recent labelled data (the student's own), so the
soft labels the student distils from track the present::

    adapted = teacher_logits + W teacher_logits + b  [+ E teacher_embedding]

It starts as the identity (W, b, E zero): with no fit it passes the teacher through unchanged.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gem_core.batch import JaggedBatch
from gem_core.metrics import task_report


class TeacherAdapter(nn.Module):
    """Maps the teacher's per-task logits (and user embedding) to corrected logits."""

    def __init__(self, tasks: Sequence[str], embedding_dim: int = 0) -> None:
        super().__init__()
        self.tasks = tuple(tasks)
        self.mix = nn.Linear(len(self.tasks), len(self.tasks))
        self.embedding = (nn.Linear(embedding_dim, len(self.tasks), bias=False)
                          if embedding_dim else None)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.zero_()

    def forward(self, batch: JaggedBatch) -> dict[str, Tensor]:
        """Adapted logits per task for a batch that carries the teacher's signals."""
        if batch.teacher_logits is None:
            raise ValueError("the adapter needs the teacher's logits in the batch")
        x = torch.stack([batch.teacher_logits[t].float() for t in self.tasks], dim=1)
        out = x + self.mix(x)
        if self.embedding is not None:
            if batch.teacher_embedding is None:
                raise ValueError("distill.adapter.use_embedding needs the teacher's user "
                                 "embedding in the batch")
            out = out + self.embedding(batch.teacher_embedding.float())[batch.candidate_rows()]
        return {task: out[:, i] for i, task in enumerate(self.tasks)}


def fit_adapter(adapter: TeacherAdapter, batches: Sequence[JaggedBatch], *, epochs: int,
                lr: float) -> dict[str, object]:
    """Fit ``adapter`` to the labels of ``batches`` (one Adam step per batch and epoch, the
    summed BCE of every task); returns the fit data's NE per task before and after."""
    before = _report(adapter, batches)
    optimizer = torch.optim.Adam(adapter.parameters(), lr=lr)
    adapter.train()
    for _ in range(epochs):
        for batch in batches:
            adapted = adapter(batch)
            loss = sum(F.binary_cross_entropy_with_logits(adapted[t], batch.labels[t])
                       for t in adapter.tasks)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    adapter.eval()
    for parameter in adapter.parameters():
        parameter.requires_grad_(False)
    after = _report(adapter, batches)
    return {"rows": sum(b.batch_size for b in batches),
            "impressions": sum(b.num_candidates for b in batches),
            "ne_before": before, "ne_after": after}


@torch.no_grad()
def _report(adapter: TeacherAdapter, batches: Iterable[JaggedBatch]) -> dict[str, float | None]:
    raw: dict[str, list[Tensor]] = {t: [] for t in adapter.tasks}
    labels: dict[str, list[Tensor]] = {t: [] for t in adapter.tasks}
    for batch in batches:
        adapted = adapter(batch)
        for task in adapter.tasks:
            raw[task].append(adapted[task])
            labels[task].append(batch.labels[task])
    return {t: task_report(torch.cat(raw[t]), torch.cat(labels[t]))["ne"] for t in adapter.tasks}
