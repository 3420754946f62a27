"""Distillation in time order (``data.order = "time"``): the Student Adapter along the windows.

A teacher trained on older windows goes staler with every window; an adapter fitted once, on
the student's first window, corrects it for that window only. With ``distill.adapter.refit =
"each_window"`` the adapter is fitted anew (from the identity) before the student trains on
window T >= 1, on window T - 1: the most recent labelled data the student has seen, read with
:meth:`~gem_core.contracts.WindowedSource.window_eval_batches` (its first requests in file
order, the same on every rank, so every rank fits the same adapter). Window 0 keeps the first
fit (:meth:`gem_core.distill.distiller.Distiller._fit_adapter`).

Whatever the mode, before the student trains on window T >= 1 the main rank records the
teacher's NE on that window's progressive-evaluation requests, raw and through the adapter in
use: the adapter's out-of-sample figure, one window ahead, like the student's progressive NE.

The refit happens in the training stream, just before the first batch of a window is attached
its signals (:class:`WindowRefit.before_batch`), so every batch is adapted by the adapter of
its own window whatever reads the stream ahead. The adapter, the window it was fitted for and
the records are the checkpoint's (``distill`` in the trainer state): a resumed run continues
with the adapter it stopped with, and refits at a window start exactly as an uninterrupted run.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import Tensor

from gem_core.batch import JaggedBatch
from gem_core.config import GemConfig
from gem_core.contracts import WindowedSource
from gem_core.distill.adapter import TeacherAdapter, fit_adapter
from gem_core.distributed import ParallelContext
from gem_core.errors import GemConfigError
from gem_core.metrics import task_report

log = logging.getLogger(__name__)

ONCE, EACH_WINDOW = "once", "each_window"


def check_refit(config: GemConfig) -> None:
    """Refuse, naming the option, a refit that cannot happen; warn when the refits read fewer
    requests than ``fit_batches`` asks for."""
    a, order = config.distill.adapter, config.data.order
    if a.refit != EACH_WINDOW:
        return
    if not a.enabled:
        raise GemConfigError("distill.adapter.refit = 'each_window' refits the Student Adapter, "
                             "which is off: set distill.adapter.enabled = true (gem distill "
                             "--adapter) or leave refit = 'once'")
    if order != "time":
        raise GemConfigError(f"distill.adapter.refit = 'each_window' refits the adapter on each "
                             f"time window; it needs data.order = 'time' (this run's is "
                             f"{order!r}): use refit = 'once'")
    wanted = a.fit_batches * config.train.batch_size
    # Unset (or the preset's, which a data set's windows replace), a window is read whole.
    capped = config.data.eval_rows is not None and "eval_rows" not in config.data.data_set_wins
    if capped and wanted > config.data.eval_rows:
        log.warning("distill.adapter.refit = 'each_window': a refit reads at most data.eval_rows"
                    " = %d requests of the previous window, fewer than distill.adapter."
                    "fit_batches * train.batch_size = %d; raise data.eval_rows to fit on more",
                    config.data.eval_rows, wanted)


def first_window_batches(stream: Any, source: WindowedSource, count: int) -> list[JaggedBatch]:
    """Up to ``count`` batches of a time-order ``stream``, none past its first window (the
    first fit must not see what the student is evaluated on later)."""
    batches = []
    while len(batches) < count and source.window_at(stream.state_dict())[0] == 0:
        try:
            batches.append(next(stream))
        except StopIteration:
            break
    return batches


@torch.no_grad()
def teacher_ne(batches: Iterable[JaggedBatch], tasks: tuple[str, ...],
               adapter: TeacherAdapter | None) -> dict[str, dict[str, float | None]]:
    """The teacher's NE per task on ``batches`` (which carry its signals): ``raw``, and
    ``adapted`` through ``adapter`` when there is one."""
    raw: dict[str, list[Tensor]] = {t: [] for t in tasks}
    adapted: dict[str, list[Tensor]] = {t: [] for t in tasks}
    labels: dict[str, list[Tensor]] = {t: [] for t in tasks}
    for batch in batches:
        corrected = adapter(batch) if adapter is not None else None
        for task in tasks:
            raw[task].append(batch.teacher_logits[task])
            labels[task].append(batch.labels[task])
            if corrected is not None:
                adapted[task].append(corrected[task])

    def ne(parts: dict[str, list[Tensor]]) -> dict[str, float | None]:
        return {t: task_report(torch.cat(parts[t]), torch.cat(labels[t]))["ne"] for t in tasks}

    report = {"raw": ne(raw)}
    if adapter is not None:
        report["adapted"] = ne(adapted)
    return report


class WindowRefit:
    """The adapter in use along the windows of a time-order run, and per window the teacher's
    figures (and, with ``each_window``, the refit's report).

    ``signals`` gives a batch the teacher's raw signals (online: computed; precomputed: read
    with the batch); ``new_adapter`` builds an identity adapter; ``first``: the first fit's
    adapter (window 0's), or None without an adapter."""

    def __init__(self, config: GemConfig, ctx: ParallelContext, source: WindowedSource, *,
                 signals: Callable[[JaggedBatch], JaggedBatch], tasks: tuple[str, ...],
                 new_adapter: Callable[[], TeacherAdapter], first: TeacherAdapter | None) -> None:
        self.config, self.ctx, self.source = config, ctx, source
        self.mode = config.distill.adapter.refit
        self.signals, self.tasks, self.new_adapter = signals, tasks, new_adapter
        self.windows = list(source.windows())
        self.adapter = first
        self.fitted_for = 0  # the window the adapter in use was fitted for
        self.records: dict[int, dict[str, Any]] = {}  # window index -> its record

    def before_batch(self, position: Mapping[str, Any]) -> None:
        """Called with the stream's position before each batch: at a window's start, refit
        the adapter (``each_window``) and record the teacher's figures on the window."""
        index, begun = self.source.window_at(position)
        if index >= len(self.windows):
            return  # every window read: the stream is about to end
        # Refitted also when a window already begun has another adapter: a checkpoint written
        # before this state was kept (the fit is a function of the data: the same adapter).
        if self.mode == EACH_WINDOW and index >= 1 and self.fitted_for != index:
            self._refit(index)
        if index >= 1 and not begun and self.ctx.is_main and (
                "teacher_ne" not in self.records.get(index, {})):
            self._record_teacher(index)

    def _refit(self, index: int) -> None:
        a, train = self.config.distill.adapter, self.config.train
        # Fitting reads no random numbers today; the fork keeps it so if the teacher ever does.
        with torch.random.fork_rng(devices=[]):
            batches = [self.signals(b) for b in itertools.islice(
                self.source.window_eval_batches(index - 1, batch_size=train.batch_size),
                a.fit_batches)]
            adapter = self.new_adapter()
            report = fit_adapter(adapter, batches, epochs=a.epochs, lr=a.lr)
        self.adapter, self.fitted_for = adapter, index
        previous = self.windows[index - 1].name
        self._record(index)["adapter_fit"] = {"window": previous, "window_index": index - 1,
                                              **report}
        if self.ctx.is_main:
            log.info("Student Adapter refitted on window %r (%d requests) for window %r: NE %s "
                     "-> %s", previous, report["rows"], self.windows[index].name,
                     report["ne_before"], report["ne_after"])

    def _record_teacher(self, index: int) -> None:
        size = self.config.train.eval_batch_size
        batches = (self.signals(b) for b in self.source.window_eval_batches(index,
                                                                            batch_size=size))
        with torch.random.fork_rng(devices=[]):
            self._record(index)["teacher_ne"] = teacher_ne(batches, self.tasks, self.adapter)

    def _record(self, index: int) -> dict[str, Any]:
        return self.records.setdefault(index, {"window": self.windows[index].name,
                                               "window_index": index})

    # -- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The adapter in use (its tensors), the window it was fitted for and the records."""
        return {"refit": self.mode, "fitted_for": self.fitted_for,
                "adapter": adapter_state(self.adapter),
                "records": [self.records[i] for i in sorted(self.records)]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.records = {int(r["window_index"]): dict(r) for r in state["records"]}
        if state["refit"] != self.mode or (state["adapter"] is None) != (self.adapter is None):
            # The configuration changed (distill.* is not compared on resume): this run's own
            # adapter stays, and each_window refits it at the window it is in.
            log.warning("the checkpoint's Student Adapter (refit = %r, %s) does not match this "
                        "run's distill.adapter (refit = %r, enabled = %s): not loaded",
                        state["refit"], "none" if state["adapter"] is None else "fitted",
                        self.mode, self.adapter is not None)
            return
        self.fitted_for = int(state["fitted_for"])
        if state["adapter"] is not None:
            self.adapter = load_adapter(self.new_adapter(), state["adapter"])

    def summary(self) -> list[dict[str, Any]]:
        """Per window evaluated so far, oldest first: the teacher's NE on it (``raw``,
        ``adapted``) and, with ``each_window``, the refit's report (``adapter_fit``: the window
        fitted on, requests, impressions and the fit data's NE before and after)."""
        return [self.records[i] for i in sorted(self.records)]


def adapter_state(adapter: TeacherAdapter | None) -> dict[str, Tensor] | None:
    """An adapter's parameters as CPU tensors for a checkpoint; None without one."""
    if adapter is None:
        return None
    return {name: value.detach().cpu().clone() for name, value in adapter.state_dict().items()}


def load_adapter(adapter: TeacherAdapter, state: Mapping[str, Tensor]) -> TeacherAdapter:
    """``adapter`` (a new one of the run's shape) with a checkpoint's parameters, frozen."""
    adapter.load_state_dict(dict(state))
    adapter.eval()
    for parameter in adapter.parameters():
        parameter.requires_grad_(False)
    return adapter
