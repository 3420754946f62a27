"""What the trainer calls when ``[distill]`` names a teacher: a data source whose batches carry
the teacher's (adapted) signals, and the student's loss.

The student's loss over the global batch's impressions (as the trainer's hard loss)::

    hard_weight * BCE(student, labels)
    + sum_t soft_weight_t * T**2 * KL(sigmoid(teacher_t / T) || sigmoid(student_t / T))
    + embedding_match_weight * MSE(projection(student user embedding), teacher user embedding)

The soft term is the Bernoulli KL divergence (the cross-entropy to the soft label less its
entropy: the same gradient, and 0 when the student matches the teacher). The embedding term is
each rank's mean over its requests (ranks then average it, as the MoE auxiliary losses).
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

from gem_core.batch import JaggedBatch
from gem_core.config import GemConfig
from gem_core.contracts import DataWindow, WindowedSource
from gem_core.data.api import DataSource, TrainStream, contiguous_balancer
from gem_core.distill.adapter import TeacherAdapter, fit_adapter
from gem_core.distill.refit import (
    WindowRefit,
    adapter_state,
    check_refit,
    first_window_batches,
    load_adapter,
    teacher_ne,
)
from gem_core.distill.teacher import open_teacher
from gem_core.distributed import ParallelContext, all_reduce_sum
from gem_core.errors import GemConfigError

log = logging.getLogger(__name__)


class _SignalStream(TrainStream):
    """A training stream whose batches get the teacher's signals; the position is the inner
    stream's (the signals are a pure function of the batch and of the window it is in).
    ``before``, when given, sees the inner stream's position before each batch (time order:
    the adapter is refitted there at a window's start)."""

    def __init__(self, inner: Any, attach: Callable[[JaggedBatch], JaggedBatch],
                 before: Callable[[Mapping[str, Any]], None] | None = None) -> None:
        self.inner, self.attach, self.before = inner, attach, before

    def __iter__(self) -> _SignalStream:
        return self

    def __next__(self) -> JaggedBatch:
        if self.before is not None:
            self.before(self.inner.state_dict())
        return self.attach(next(self.inner))

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def close(self) -> None:
        self.inner.close()


class TeacherSignalSource(DataSource):
    """The student's data source with the teacher's signals attached to every training batch
    (and to eval batches when the student's model reads the teacher's embedding). Everything
    else (``schema``, ``fingerprint()``, ``report()``) is the wrapped source's."""

    def __init__(self, inner: Any, attach: Callable[[JaggedBatch], JaggedBatch], *,
                 attach_eval: bool,
                 before: Callable[[Mapping[str, Any]], None] | None = None) -> None:
        self.inner, self._attach, self._attach_eval = inner, attach, attach_eval
        self._before = before
        self.schema = inner.schema

    def train_stream(self, **kwargs: Any) -> _SignalStream:
        return _SignalStream(self.inner.train_stream(**kwargs), self._attach, self._before)

    def eval_batches(self, **kwargs: Any) -> Iterator[JaggedBatch]:
        for batch in self.inner.eval_batches(**kwargs):
            yield self._attach(batch) if self._attach_eval else batch

    def fingerprint(self) -> dict[str, Any]:
        return self.inner.fingerprint()

    def report(self) -> dict[str, Any]:
        return self.inner.report()


class WindowedSignalSource(TeacherSignalSource, WindowedSource):
    """:class:`TeacherSignalSource` of a source with time windows: its windows are the wrapped
    source's, their evaluation batches get the signals as ``eval_batches``' do."""

    inner: WindowedSource

    def windows(self) -> Sequence[DataWindow]:
        return self.inner.windows()

    def window_at(self, position: Mapping[str, Any]) -> tuple[int, bool]:
        return self.inner.window_at(position)

    def window_eval_batches(self, index: int, *, batch_size: int) -> Iterator[JaggedBatch]:
        for batch in self.inner.window_eval_batches(index, batch_size=batch_size):
            yield self._attach(batch) if self._attach_eval else batch


@attrs.frozen(kw_only=True)
class Weights:
    """The weights of the student's loss terms, resolved against the data's tasks."""

    hard: float
    """Weight of the loss on the data's labels."""
    soft: Mapping[str, float]
    """Per task, weight of the soft-label KL term."""
    embedding_match: float
    """Weight of the user-embedding MSE."""
    temperature: float
    """Soft-label temperature."""

    def as_dict(self) -> dict[str, Any]:
        return {"hard": self.hard, "soft": dict(self.soft),
                "embedding_match": self.embedding_match, "temperature": self.temperature}


class Distiller:
    """The distillation of one student run: its data source and its loss."""

    def __init__(self, config: GemConfig, source: Any, ctx: ParallelContext) -> None:
        d = config.distill
        self.config, self.ctx = config, ctx
        tasks = source.schema.tasks
        unknown = sorted(set(d.task_soft_weights) - set(tasks))
        if unknown:
            raise GemConfigError(f"distill.task_soft_weights names tasks {unknown}; the data's "
                                 f"tasks are {list(tasks)}")
        self.weights = Weights(
            hard=d.hard_weight, embedding_match=d.embedding_match_weight,
            temperature=d.temperature,
            soft={t: float(d.task_soft_weights.get(t, d.soft_weight)) for t in tasks})
        self.tasks = tasks
        self.soft_tasks = [t for t in tasks if self.weights.soft[t] > 0]
        self.needs_embedding = bool(d.embedding_feature or d.embedding_match_weight > 0
                                    or (d.adapter.enabled and d.adapter.use_embedding))
        # Opening the teacher builds a model: keep the student's initialisation untouched. It
        # runs on the CPU, where load_run resolved its backends, on batches the stream yields
        # (before the trainer moves them to the device).
        with torch.random.fork_rng(devices=[]):
            self.teacher = open_teacher(d.teacher, data=config.data,
                                        step=d.teacher_step or None)
        self._check_teacher()
        check_refit(config)
        if d.signals == "precomputed":
            self._check_precomputed(source)
        self._adapter: TeacherAdapter | None = None  # the first fit's
        self.adapter_report: dict[str, Any] = {}
        # Time order: the windows' adapter (refitted per window with refit = each_window) and
        # figures. A source without windows is refused by the trainer's time-order checks.
        self.windows: WindowRefit | None = None
        time_order = config.data.order == "time" and isinstance(source, WindowedSource)
        wrapper = WindowedSignalSource if isinstance(source, WindowedSource) else (
            TeacherSignalSource)
        self.source = wrapper(source, self._attach, attach_eval=d.embedding_feature,
                              before=self._before_batch if time_order else None)
        if d.adapter.enabled:
            self._fit_adapter(source, time_order=time_order)
        if time_order:
            self.windows = WindowRefit(config, ctx, source, signals=self._signals,
                                       tasks=self.teacher.tasks, new_adapter=self._new_adapter,
                                       first=self._adapter)
        # In time order there is no eval split (every window trains): the teacher's figures
        # are the windows' (self.windows), recorded as the stream reaches each window.
        self.teacher_eval = (self._evaluate_teacher(source) if ctx.is_main and not time_order
                             else {})
        log.info("distilling from %s (step %d: %s; signals %s): weights %s%s", d.teacher,
                 self.teacher.run.step, self.teacher.run.choice.reason, d.signals,
                 self.weights.as_dict(),
                 "" if self.adapter is None else ", with the Student Adapter" + (
                     " refitted on each window" if d.adapter.refit == "each_window" else ""))

    @property
    def adapter(self) -> TeacherAdapter | None:
        """The adapter the soft labels go through now (in time order: the current window's)."""
        return self.windows.adapter if self.windows is not None else self._adapter

    # -- set-up -----------------------------------------------------------------------------

    def _check_teacher(self) -> None:
        missing = [t for t in self.soft_tasks if t not in self.teacher.tasks]
        if missing:
            raise GemConfigError(f"the teacher {self.config.distill.teacher} has no head for "
                                 f"tasks {missing}")

    def _check_precomputed(self, source: Any) -> None:
        schema, d = source.schema, self.config.distill
        where = (f"data set {self.config.data.path}" if self.config.data.path
                 else f"data source {self.config.data.source!r}")
        missing = [t for t in self.soft_tasks if t not in schema.teacher_tasks]
        if missing or (self.needs_embedding and not schema.teacher_embedding_dim):
            what = (f"teacher logits of {missing}" if missing
                    else "the teacher's user embeddings")
            raise GemConfigError(
                f"distill.signals = 'precomputed' but the {where} has no {what} (its schema's "
                f"teacher_tasks = {list(schema.teacher_tasks)}, teacher_embedding_dim = "
                f"{schema.teacher_embedding_dim}); write them with gem distill-precompute "
                f"--teacher {d.teacher} --data DATASET --out DATASET, or use signals = 'online'")
        if self.needs_embedding and schema.teacher_embedding_dim != self.teacher.embedding_dim:
            raise GemConfigError(
                f"the {where} carries {schema.teacher_embedding_dim}-float teacher embeddings; "
                f"the teacher {d.teacher} makes {self.teacher.embedding_dim}: the columns come "
                "from another teacher")

    def _signals(self, batch: JaggedBatch) -> JaggedBatch:
        """The batch with the teacher's raw signals (online: computed here; precomputed: read
        with the batch)."""
        if self.config.distill.signals == "online":
            batch = self.teacher.attach(batch, embedding=self.needs_embedding)
        return batch

    def _attach(self, batch: JaggedBatch) -> JaggedBatch:
        """The batch with the teacher's signals, the logits replaced by the adapter's when
        there is one."""
        batch = self._signals(batch)
        adapter = self.adapter
        if adapter is not None:
            with torch.no_grad():
                batch = attrs.evolve(batch, teacher_logits=adapter(batch))
        return batch

    def _before_batch(self, position: Mapping[str, Any]) -> None:
        """Time order, before each training batch: the windows' refit and records."""
        if self.windows is not None:
            self.windows.before_batch(position)

    def _new_adapter(self) -> TeacherAdapter:
        use_embedding = self.config.distill.adapter.use_embedding
        return TeacherAdapter(self.teacher.tasks,
                              self.teacher.embedding_dim if use_embedding else 0)

    def _fit_adapter(self, source: Any, *, time_order: bool) -> None:
        a = self.config.distill.adapter
        stream = source.train_stream(batch_size=self.config.train.batch_size, rank=0,
                                     world_size=1, balancer=contiguous_balancer,
                                     cost_fn=lambda b: [1.0] * b.batch_size)
        try:
            batches = (first_window_batches(stream, source, a.fit_batches) if time_order
                       else list(itertools.islice(stream, a.fit_batches)))
            batches = [self._signals(b) for b in batches]
        finally:
            stream.close()  # join a file-backed stream's read-ahead thread
        adapter = self._new_adapter()
        self.adapter_report = fit_adapter(adapter, batches, epochs=a.epochs, lr=a.lr)
        self._adapter = adapter
        log.info("Student Adapter fitted on %d requests: NE %s -> %s",
                 self.adapter_report["rows"], self.adapter_report["ne_before"],
                 self.adapter_report["ne_after"])

    def _evaluate_teacher(self, source: Any) -> dict[str, Any]:
        """The teacher's NE on the student's eval split, raw and through the adapter."""
        batches = (self._signals(b)
                   for b in source.eval_batches(batch_size=self.config.train.eval_batch_size))
        return teacher_ne(batches, self.teacher.tasks, self.adapter)

    # -- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (``distill`` in the trainer state): the adapter in use (and
        in time order the window it was fitted for and the windows' records)."""
        if self.windows is not None:
            return {"windows": self.windows.state_dict()}
        return {"adapter": adapter_state(self._adapter)}

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """A checkpoint's :meth:`state_dict`; None (a checkpoint written before it was kept):
        the adapter fitted at start-up stays, refitted per window as the stream goes on."""
        if state is None:
            return
        if self.windows is not None:
            if "windows" in state:
                self.windows.load_state_dict(state["windows"])
            return
        if state.get("adapter") is not None and self._adapter is not None:
            self._adapter = load_adapter(self._new_adapter(), state["adapter"])

    # -- the step ---------------------------------------------------------------------------

    def loss(self, logits: Mapping[str, Tensor], batch: JaggedBatch, task_sums: Tensor,
             impressions: float, model: Any) -> tuple[Tensor, dict[str, float]]:
        """The student's loss from its logits, the batch (with teacher signals), the per-task
        BCE sums of the hard labels and the global batch's impressions; and the step's record
        of every term (reduced over ranks)."""
        w, ctx = self.weights, self.ctx
        scale = ctx.world_size / max(impressions, 1.0)
        if batch.teacher_logits is None:
            raise ValueError("distillation needs the teacher's logits in every training batch")
        temperature = w.temperature
        kl_sums = torch.stack([_bernoulli_kl_sum(batch.teacher_logits[t].float() / temperature,
                                                 logits[t].float() / temperature)
                               for t in self.soft_tasks]) if self.soft_tasks else None
        loss = task_sums.sum() * (w.hard * scale)
        if kl_sums is not None:
            soft = torch.tensor([w.soft[t] for t in self.soft_tasks], device=kl_sums.device)
            loss = loss + (soft * kl_sums).sum() * (temperature ** 2 * scale)
        mse = None
        if w.embedding_match:
            if batch.teacher_embedding is None:
                raise ValueError("distill.embedding_match_weight needs the teacher's embedding")
            mse = F.mse_loss(model.matched_user_embedding().float(),
                             batch.teacher_embedding.float())
            loss = loss + w.embedding_match * mse
        local = [float(loss.detach()),
                 *(kl_sums.detach().double().tolist() if kl_sums is not None else []),
                 float(mse.detach()) if mse is not None else 0.0]
        reduced = all_reduce_sum(torch.tensor(local, dtype=torch.float64), ctx).tolist()
        # Each rank's loss is its share of the global mean (plus its mean embedding term):
        # their mean over ranks is the global batch's loss.
        record = {"distill_loss": reduced[0] / ctx.world_size}
        record.update({f"distill_soft_kl_{t}": reduced[1 + i] / max(impressions, 1.0)
                       for i, t in enumerate(self.soft_tasks)})
        if mse is not None:
            record["distill_embedding_mse"] = reduced[-1] / ctx.world_size
        return loss, record

    def summary(self) -> dict[str, Any]:
        d = self.config.distill
        return {
            "teacher": str(Path(d.teacher)), "teacher_step": self.teacher.run.step,
            "teacher_checkpoint": self.teacher.run.choice.reason,
            "signals": d.signals, "weights": self.weights.as_dict(),
            "embedding_feature": d.embedding_feature,
            "adapter": ({"fit": self.adapter_report, "fit_batches": d.adapter.fit_batches,
                         "epochs": d.adapter.epochs, "lr": d.adapter.lr,
                         "use_embedding": d.adapter.use_embedding, "refit": d.adapter.refit}
                        if self.adapter is not None else None),
            "teacher_eval_ne": self.teacher_eval,
            # Time order: per window, the teacher's NE on it before the student trained on it
            # (raw, adapted) and each refit's report.
            **({"windows": self.windows.summary()} if self.windows is not None else {}),
        }


def _bernoulli_kl_sum(target_logits: Tensor, student_logits: Tensor) -> Tensor:
    """Sum over impressions of KL(Bernoulli(sigmoid(target)) || Bernoulli(sigmoid(student)))."""
    p = torch.sigmoid(target_logits)
    cross = F.binary_cross_entropy_with_logits(student_logits, p, reduction="sum")
    entropy = F.binary_cross_entropy_with_logits(target_logits, p, reduction="sum")
    return cross - entropy


def build_distiller(config: GemConfig, source: Any, ctx: ParallelContext) -> Distiller | None:
    """The run's :class:`Distiller`, or None when ``[distill]`` names no teacher."""
    return Distiller(config, source, ctx) if config.distill.enabled else None
