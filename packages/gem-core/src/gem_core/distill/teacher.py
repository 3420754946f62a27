"""The teacher: a trained run opened through :func:`gem_core.trained_run.load_run`, giving per
task logits and (with PMA) a user embedding for each batch."""

from __future__ import annotations

from pathlib import Path

import attrs
import torch
from torch import Tensor

from gem_core.batch import JaggedBatch
from gem_core.config import DataConfig
from gem_core.distill.setup import teacher_embedding_width
from gem_core.trained_run import LoadedRun, load_run


class Teacher:
    """A trained model in eval mode on ``device``; :meth:`signals` runs it without gradients."""

    def __init__(self, run: LoadedRun, device: torch.device | str = "cpu") -> None:
        self.run = run
        self.device = torch.device(device)
        self.model = run.model.to(self.device)
        self.tasks = run.schema.tasks
        self.embedding_dim = teacher_embedding_width(run.config.model)

    @torch.no_grad()
    def signals(self, batch: JaggedBatch, *, embedding: bool = True
                ) -> tuple[dict[str, Tensor], Tensor | None]:
        """Per task ``(N,)`` float32 logits and, when ``embedding`` and the teacher has one, its
        ``(R, width)`` user embedding, on the batch's device."""
        device = batch.seq_offsets.device
        view = batch.to(self.device)
        logits = {task: value.float().to(device) for task, value in self.model(view).items()}
        user = None
        if embedding and self.embedding_dim:
            user = self.model.user_embedding(view).float().to(device)
        return logits, user

    def attach(self, batch: JaggedBatch, *, embedding: bool = True) -> JaggedBatch:
        """``batch`` carrying the teacher's signals (``teacher_logits``, ``teacher_embedding``)."""
        logits, user = self.signals(batch, embedding=embedding)
        return attrs.evolve(batch, teacher_logits=logits, teacher_embedding=user)


def open_teacher(run_dir: str | Path, *, data: DataConfig | None = None,
                 device: torch.device | str = "cpu", step: int | None = None) -> Teacher:
    """The teacher of ``run_dir`` at its best complete checkpoint (by evaluation NE) or
    ``step``'s; ``data``: the student's data, whose feature schema must be the teacher's (an
    error names what differs)."""
    return Teacher(load_run(Path(run_dir), data=data, step=step), device)
