"""The training loop, over a run assembled by :mod:`gem_core.train.assembly` (where every backend
is resolved once and injected; nothing is global)."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Sequence

import attrs
import torch

from gem_core.batch import JaggedBatch
from gem_core.checkpoint.checkpointer import Checkpointer
from gem_core.checkpoint.layout import latest_checkpoint, remove_torn
from gem_core.checkpoint.resume import (
    MODEL_FORMAT,
    check_compatible,
    check_steps_cover,
    load_data_position,
)
from gem_core.config import GemConfig, unstructure
from gem_core.distill.setup import resolve_distillation
from gem_core.distributed import (
    ParallelContext,
    all_reduce_sum,
    init_from_environment,
    shutdown,
)
from gem_core.model.id_bias import id_bias_parameters
from gem_core.plugins import GemPlugins
from gem_core.schema import schema_to_dict
from gem_core.train.accounting import RunAccounting
from gem_core.train.assembly import RunAssembly
from gem_core.train.data_fingerprint import STATE_KEY, check_same_data
from gem_core.train.data_log import CountedRequests, evaluated_line, log_data_counts
from gem_core.train.environment import WRITE_ONLY_ERRNOS, write_errors_named
from gem_core.train.evaluate import VALIDATION, evaluate, selection_ne
from gem_core.train.guard import StepGuard
from gem_core.train.loss import task_loss_sums
from gem_core.train.optim import learning_rate
from gem_core.train.peak import measure_matmul_peak
from gem_core.train.progress import Progress, log_start
from gem_core.train.random_state import rng_state, set_rng_state
from gem_core.train.run_dir import RunDirectory, evaluation_columns
from gem_core.train.run_end import (
    early_stop,
    epochs_done,
    log_epochs_plan,
    ne_history,
    overfitting_warning,
)
from gem_core.train.run_lock import hold_run_directory
from gem_core.train.stop_signal import RunStopped, StopSignals
from gem_core.train.summary import evaluation_summary, run_record
from gem_core.train.table_optimizer import set_step_impressions
from gem_core.train.table_reset import reinitialize_tables
from gem_core.train.teardown import stop_background_work

log = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class TrainResult:
    run_dir: Path
    summary: dict[str, Any]


def train(config: GemConfig, plugins: GemPlugins, run_dir: Path, *, fresh: bool = False,
          progress: bool = True, until_step: int | None = None,
          allow_data_change: bool = False) -> TrainResult:
    """Train ``config`` into ``run_dir`` (resuming from its latest checkpoint unless ``fresh``).

    ``until_step`` stops (with a checkpoint) after that step, with the schedule of the whole run
    unchanged, so that running again continues exactly where it stopped. The run holds
    ``run_dir``'s lock throughout (one trainer per directory); resuming on data other than the
    checkpoint's is refused unless ``allow_data_change``. SIGTERM and SIGINT stop it after a
    step, all ranks at the same one, with a checkpoint of that step: :class:`RunStopped` (see
    :mod:`gem_core.train.stop_signal`).
    """
    config = resolve_distillation(config)  # [distill]'s model options, from the teacher
    ctx = init_from_environment(config.train.device)
    trainer, failed = None, True
    try:
        # A full disk anywhere in the run (a background checkpoint too) is named with its path.
        with hold_run_directory(Path(run_dir), ctx), write_errors_named(
                "the run's files", Path(run_dir), errnos=WRITE_ONLY_ERRNOS), StopSignals(
                config.train.stop_grace_s, announce=ctx.is_main) as stop:
            try:
                trainer = _Trainer(config, plugins, Path(run_dir), ctx, fresh=fresh,
                                   progress=progress, allow_data_change=allow_data_change,
                                   stop=stop)
                result, failed = trainer.run(until_step), False
                return result
            finally:  # every background thread joined while the group and the lock still exist
                stop_background_work(trainer, failed=failed)
    finally:
        shutdown(ctx)


class _Trainer(RunAssembly):
    def __init__(self, config: GemConfig, plugins: GemPlugins, run_dir: Path,
                 ctx: ParallelContext, *, fresh: bool, progress: bool,
                 allow_data_change: bool = False, stop: StopSignals | None = None) -> None:
        # Asked to stop (a signal): read in each step's reduction, so all ranks agree.
        self.stop = stop if stop is not None else StopSignals(config.train.stop_grace_s)
        self.stopping = False
        self.allow_data_change = allow_data_change
        if config.train.deterministic:
            torch.use_deterministic_algorithms(True)
        self.run_dir = RunDirectory(run_dir, enabled=ctx.is_main,
                                    tensorboard=config.train.tensorboard)
        if fresh:
            self.run_dir.start_fresh()
        self.show_progress = progress
        super().__init__(config, plugins, run_dir, ctx)
        self.step = 0
        self.saved_step: int | None = None  # of the newest checkpoint this run wrote or resumed
        self.guard = StepGuard(self.tc)
        self.checkpointer = Checkpointer(
            run_dir, ctx, self.engine, self.tc,
            checkpoint_classes=self.backends.dense_sharding.impl.checkpoint_classes)
        self.eval_history: list[dict[str, Any]] = []
        self.ending: dict[str, str] | None = None  # why the run ends before train.steps
        self.warnings: list[str] = []
        self.passes_done: int | None = 0
        self.tables_reinitialized = 0  # passes after which train.tables_each_pass drew them anew
        self.accounting = RunAccounting(self.schema.tasks, ctx)

    # -- checkpoints ---------------------------------------------------------------------------

    def _resume(self) -> None:
        if self.ctx.is_main:
            for torn in remove_torn(self.run_dir.path):
                log.warning("removed %s: a checkpoint whose save never finished", torn)
        found = self.checkpointer.newest_intact()  # verified; damaged newer ones are skipped
        if found is None:
            self.run_dir.truncate_metrics(after_step=0)  # lines of a run that saved nothing
            return
        step, path = found
        state = self.checkpointer.read_state(path)
        check_steps_cover(step, self.tc.steps, path)
        check_compatible(state, path, config=self.config,
                         strategy=self.backends.dense_sharding.spec.name,
                         engine_format=self.checkpointer.format, world_size=self.ctx.world_size,
                         schema=schema_to_dict(self.schema),
                         allow_data_change=self.allow_data_change)
        check_same_data(state.get(STATE_KEY), self._data_fingerprint(), path,
                        allow_change=self.allow_data_change)
        load_data_position(self.stream, state, path, rank=self.ctx.rank,
                           world_size=self.ctx.world_size, source=self.config.data.source)
        self._restore(state, path)
        if self.distiller is not None:  # not in _restore: a rollback keeps the stream's adapter
            self.distiller.load_state_dict(state.get("distill"))
        self.saved_step = step
        self.run_dir.truncate_metrics(after_step=step, evaluations=self.eval_history)
        log.info("resumed from %s at step %d", path, step)
        if state["world_size"] != self.ctx.world_size:
            # Resharded: evaluate at once, so eval_history shows the same NE as before the
            # stop (two entries for this step) and a bad load would be seen before training.
            log.info("resharded from %d to %d ranks; evaluating the loaded model",
                     state["world_size"], self.ctx.world_size)
            self._evaluate()

    def _restore(self, state: dict[str, Any], path: Path) -> None:
        """Model, optimizer, RNG, counters and guard as saved (the data position is separate:
        a rollback keeps the stream where it is so the bad batches are not seen again). With
        another number of ranks, rank r takes the RNG state of saved rank r modulo the saved
        number."""
        self.checkpointer.load_engine(path, state)
        rng = state["rng"]
        set_rng_state(rng[self.ctx.rank % len(rng)])
        self.step = state["step"]
        self.accounting.totals = state["totals"]
        self.eval_history = state["eval_history"]
        self.guard.load_state_dict(state["guard"])
        # absent from checkpoints written before train.tables_each_pass (none were reset)
        self.tables_reinitialized = state.get("tables_reinitialized", 0)

    def _roll_back(self) -> None:
        self.checkpointer.wait()  # a checkpoint still being written in the background counts
        found = self.checkpointer.newest_intact()
        # Stops the run when there is no checkpoint or after train.max_rollbacks in a row.
        kept = self.guard.before_rollback(found and found[0], last_step=self.step + 1)
        step, path = found
        self._restore(self.checkpointer.read_state(path), path)
        self.guard.after_rollback(kept)
        self.run_dir.truncate_metrics(after_step=step)
        log.warning("rolled back to %s (step %d); the batches since are skipped", path, step)

    def _save(self) -> None:
        data_states = _gather_objects(self.steps.data_position(), self.ctx)  # last trained
        rng_states = _gather_objects(rng_state(), self.ctx)
        last = self.eval_history[-1] if self.eval_history else None
        ne = (selection_ne(last, self.schema.tasks)
              if last is not None and last["step"] == self.step and self.time_order is None
              else None)  # in time order each evaluation is of another window: no ranking
        state = {
            "step": self.step, "data": data_states,
            "rng": rng_states, "totals": self.accounting.totals, "eval_history": self.eval_history,
            "config": unstructure(self.config), "world_size": self.ctx.world_size,
            "guard": self.guard.state_dict(),
            "tables_reinitialized": self.tables_reinitialized,
            "dense_sharding": self.backends.dense_sharding.spec.name,
            "embedding_sharding": self.backends.embedding_sharding.spec.name,
            "model_format": MODEL_FORMAT, "schema": schema_to_dict(self.schema),
            STATE_KEY: self._data_fingerprint(),
            **({"distill": self.distiller.state_dict()} if self.distiller is not None else {}),
        }
        with write_errors_named(f"the checkpoint of step {self.step}",
                                self.run_dir.path / "checkpoints"):
            self.checkpointer.save(self.step, state, ne=ne,
                                   ne_of=VALIDATION if self.tc.validation_share else "eval")
        self.saved_step = self.step

    def _stop(self, *, saved: bool) -> None:
        """End the run after this step on a signal: its checkpoint saved (unless it just was)
        and published, then :class:`RunStopped` (every rank together)."""
        if not saved:
            self._save()
        self.checkpointer.wait()
        found = latest_checkpoint(self.run_dir.path)
        stopped = RunStopped(signum=self.stop.signum, step=self.step,
                             checkpoint=found[1] if found and found[0] == self.step else None,
                             run_dir=self.run_dir.path)
        if self.ctx.is_main and self.ctx.is_distributed:  # one process: the CLI prints it
            log.warning("%s", stopped)
        raise stopped

    # -- the loop -------------------------------------------------------------------------------

    def run(self, until_step: int | None = None) -> TrainResult:
        self._resume()
        stop = min(self.tc.steps, until_step) if until_step else self.tc.steps
        self.run_dir.write_config(self.config)
        self.run_dir.open_tensorboard(first_step=self.step)
        with torch.random.fork_rng(devices=[]):  # random matrices; the training RNG stays exact
            peak = measure_matmul_peak(self.ctx.device)
        start_step, started = self.step, time.perf_counter()
        bar = self._start(stop)
        while self.step < stop and self.ending is None:
            looped = time.perf_counter()  # the step as the loop sees it, batch fetch included
            self._reinitialize_tables_at_a_new_pass()
            record = self.steps.run_step(lambda batch: self._train_step(batch, peak))
            record["loop_step_time_s"] = time.perf_counter() - looped
            if self.guard.must_roll_back:
                self._roll_back()
                bar.update_to(self.step)
                continue
            self.step += 1
            self.checkpointer.poll()
            self._count_passes()
            passes_ended = self._ending(evaluations=False) is not None
            last = self.step == stop or passes_ended
            window_ended = False
            if self.time_order is not None:  # evaluations are the windows', before training
                window_ended = self.time_order.at_window_start(self.steps.data_position())
                evaluated = window_ended and self._evaluate_due_window()
                if evaluated:
                    record.update(evaluation_columns(self.eval_history[-1]))
                self.ending = self._ending()
                last = last or self.ending is not None
            else:
                evaluated = last or bool(self.tc.eval_every
                                         and self.step % self.tc.eval_every == 0)
            if evaluated and self.time_order is None:
                self._evaluate()
                record.update(evaluation_columns(self.eval_history[-1]))
                self._warn_if_overfitting()
                self.ending = self._ending()
                last = last or self.ending is not None
            if self.step % self.tc.log_every == 0 or self.step == self.tc.steps or evaluated:
                self.run_dir.append_metrics(record)
            bar.update(record)
            saved = last or window_ended or bool(self.tc.checkpoint_every
                                                 and self.step % self.tc.checkpoint_every == 0)
            if saved:
                self._save()
            if self.stopping and not last:  # every rank after the same step
                bar.close()
                self._stop(saved=saved)
        bar.close()
        if self.ending is not None and self.ctx.is_main:  # the end of the windows is no alarm
            (log.info if self.ending["reason"] == "windows" else log.warning)(
                "%s", self.ending["message"])
        if self.time_order is not None:
            if self.saved_step != self.step:
                self._save()  # a window's evaluation after the last save (a resumed run)
        elif not self.eval_history or self.eval_history[-1]["step"] != self.step:
            self._evaluate()  # a resumed run that had nothing left to train
            self._save()
        self.checkpointer.wait()  # the last background save is published before the summary
        summary = self._summary(peak, start_step, time.perf_counter() - started)
        self.run_dir.write_summary(summary)
        self.run_dir.close()
        if self.compiled is not None:
            self.compiled.close()
        if self.ctx.is_main:
            log_data_counts(self.source, "at the end of the run")
        return TrainResult(run_dir=self.run_dir.path, summary=summary)

    def _start(self, stop: int) -> Progress:
        """Say what runs, set the model training and find whether there is anything left to
        train before ``stop``; the progress bar (or lines) of the steps to come."""
        total = self.schedule_steps  # train.steps, or where train.epochs passes end
        if self.time_order is not None:  # one pass over the windows, if shorter
            planned = self.time_order.planned_steps(
                self.tc.batch_size, bool(self.config.data.options.get("token_budget")))
            total = min(total, planned) if planned else total
        bar = Progress(total=total, initial=self.step, stop=min(stop, total),
                       enabled=self.ctx.is_main, bar=self.show_progress,
                       log_every_s=self.tc.log_every_s)
        if self.ctx.is_main:
            log_start(self.config, self.backends.describe(), device=self.ctx.device.type,
                      world_size=self.ctx.world_size, start_step=self.step, stop=stop,
                      run_dir=self.run_dir.path)
        self.engine.train()
        self.passes_done = self._passes()
        if self.ctx.is_main:
            log_epochs_plan(self.tc, self.config.data.source, self.passes_done,
                            time_order=self.time_order is not None,
                            schedule_steps=self.schedule_steps)
        if self.time_order is not None:
            self._start_windows(stop)
        self.ending = self._ending()  # a resumed run that had already stopped early
        if self.ending is not None and self.ctx.is_main:
            log.info("nothing to train: %s", self.ending["message"])
        return bar

    def _train_step(self, batch: JaggedBatch, peak: float) -> dict[str, Any]:
        ctx = self.ctx
        started = time.perf_counter()
        batch = batch.to(ctx.device)
        learning_rates = self._follow_schedule()
        with self.backends.precision.impl.autocast(ctx.device.type):
            logits = self.engine(batch)
        # Sum over the local impressions, divided by the global batch's impressions and
        # multiplied by the world size: averaging gradients across ranks then gives the gradient
        # of the mean over every impression of the global batch (requests hold several).
        task_sums = task_loss_sums(logits, batch, self.schema.tasks)
        impressions = float(batch.num_candidates)
        if ctx.world_size > 1:
            impressions = all_reduce_sum(torch.tensor([impressions], dtype=torch.float64),
                                         ctx).item()
        loss = task_sums.sum() * (ctx.world_size / max(impressions, 1.0))
        # Per-impression optimizer groups (model.id_bias) step by how many impressions it averages.
        set_step_impressions(self.engine.optimizer, impressions)
        distill_record: dict[str, float] = {}
        if self.distiller is not None:
            loss, distill_record = self.distiller.loss(logits, batch, task_sums, impressions,
                                                       self.engine.unwrapped)
        # The model's auxiliary losses (MoE load balancing), each a mean over this rank's rows:
        # gradient averaging across ranks then trains their mean. Its per-impression losses are
        # sums, normalised like the task losses.
        aux_losses = self.engine.unwrapped.auxiliary_losses()
        if aux_losses:
            loss = loss + sum(aux_losses.values())
        model_sums = self.engine.unwrapped.impression_loss_sums()
        if model_sums:
            loss = loss + sum(model_sums.values()) * (ctx.world_size / max(impressions, 1.0))
        self.engine.backward(loss)
        grad_norm = float(self.engine.clip_grad_norm(self.tc.grad_clip))
        reduced = self.accounting.reduce(batch, self.engine.unwrapped, task_sums,
                                         model_sums=model_sums,
                                         impressions=impressions, grad_norm=grad_norm,
                                         stop_requested=self.stop.requested)
        self.stopping = reduced.stop
        skipped = self._optimizer_step(reduced.loss,
                                       math.inf if reduced.nonfinite_grad else grad_norm)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        record = self.accounting.step_record(
            self.step + 1, reduced, step_time=time.perf_counter() - started, peak=peak,
            trainer_figures={**learning_rates, "grad_norm": grad_norm,
                             **(self.compiled.step_record() if self.compiled is not None else {})},
            model=self.engine.unwrapped, aux_losses=aux_losses)
        record.update(distill_record)
        if skipped is not None:
            record["skipped"] = skipped
        return record

    def _follow_schedule(self) -> dict[str, float]:
        """Set this step's learning rate; ``lr`` and, where a module has an optimizer of its own
        (TorchRec's fused sparse one), its ``sparse_lr``."""
        lr = learning_rate(self.tc, self.step, self.lr_schedule, last_step=self.schedule_steps)
        self.engine.set_lr(lr)
        # They see the schedule's factor through ``follow_learning_rate(factor) -> lr | None``.
        sparse_lr = [m.follow_learning_rate(lr / self.tc.lr) for m in self._lr_followers]
        sparse_lr = [x for x in sparse_lr if x is not None]
        return {"lr": lr, **({"sparse_lr": sparse_lr[0]} if sparse_lr else {})}

    def _optimizer_step(self, loss: float, grad_norm: float) -> str | None:
        """Take the optimizer step unless the guard skips it (every rank alike: ``loss`` and
        ``grad_norm`` are the same on all); why it was skipped, or None."""
        skipped = self.guard.verdict(loss, grad_norm)
        self.guard.record(loss, skipped)
        if skipped is None:
            self.engine.step()
            # e.g. FP8 scales for FSDP2's FP8 all-gather
            self.backends.precision.impl.after_optimizer_step(self.engine.model)
        else:
            self.engine.zero_grad()
            log.warning("step %d skipped: %s", self.step + 1, skipped)
        return skipped

    def _evaluate(self, window: int | None = None) -> None:
        """Evaluate on the eval split, or (time order) on time window ``window``."""
        was_training = self.engine.model.training
        self.engine.train(False)
        size = self.tc.eval_batch_size
        batches = CountedRequests(
            self.source.eval_batches(batch_size=size) if window is None else
            self.time_order.source.window_eval_batches(window, batch_size=size))
        # Evaluating must not move the training RNG, so where evaluations fall (eval_every, a
        # stop and resume) never changes training.
        with torch.random.fork_rng(devices=[]):
            report = evaluate(self.engine, batches, self.schema.tasks, self.ctx,
                              precision=self.backends.precision.impl,
                              validation_share=0.0 if window is not None
                              else self.tc.validation_share)
        self.engine.train(was_training)
        described = self.time_order.describe(window) if window is not None else {}
        entry = {"step": self.step, **described, **report}
        self.eval_history.append(entry)
        if self.ctx.is_main:
            self.run_dir.append_eval(entry)
            log.info("eval at step %d%s: %s%s; %s", self.step,
                     f" of window {described['window']!r} before training on it"
                     if described else "", _rounded_ne(report, self.schema.tasks),
                     f" (validation part, which ranks checkpoints: "
                     f"{_rounded_ne(report[VALIDATION], self.schema.tasks)})"
                     if VALIDATION in report else "",
                     evaluated_line(batches, self.config.data.eval_rows, self.source, window))
            log_data_counts(self.source, f"at step {self.step}")

    # -- time order -------------------------------------------------------------------------------

    def _start_windows(self, stop: int) -> None:
        """Say what lies ahead, and evaluate the next window if it is due (a run continuing
        on a data set that gained windows evaluates the first new one before training)."""
        order = self.time_order
        position = self.steps.data_position()
        if self.ctx.is_main:
            order.log_plan(order.position(position)[0], stop,
                           order.planned_steps(self.tc.batch_size,
                                               bool(self.config.data.options.get("token_budget"))))
        self._evaluate_due_window()

    def _evaluate_due_window(self) -> bool:
        """Evaluate the next window if it is due (:meth:`TimeOrder.due`); whether it was."""
        due = self.time_order.due(self.steps.data_position(), self.eval_history)
        if due is None:
            return False
        self._evaluate(window=due)
        return True

    # -- when to end, which checkpoint counts ----------------------------------------------------

    def _reinitialize_tables_at_a_new_pass(self) -> None:
        """``train.tables_each_pass = "reinitialize"``: before the first step of each pass after
        the first (:mod:`gem_core.train.table_reset`)."""
        if (self.tc.tables_each_pass != "reinitialize" or not self.passes_done
                or self.passes_done <= self.tables_reinitialized):
            return
        # The per-id offsets (model.id_bias) and their state are per-id parameters too.
        offsets = id_bias_parameters(self.model)
        reinitialize_tables(self.model.embeddings, self.engine.optimizer, seed=self.tc.seed,
                            passes=self.passes_done, offsets=offsets)
        self.tables_reinitialized = self.passes_done
        if self.ctx.is_main:
            log.info("train.tables_each_pass = reinitialize: the feature tables start pass %d "
                     "with fresh rows and no optimizer state%s (step %d)", self.passes_done + 1,
                     ", the id_bias offsets at 0" if offsets else "", self.step)

    def _count_passes(self) -> None:
        if self.passes_done is None:
            return  # the stream has no passes
        passes = self._passes()
        if passes is not None and passes > self.passes_done and self.ctx.is_main:
            log.info("pass %d over the training data ended at step %d", passes, self.step)
        self.passes_done = passes

    def _ending(self, *, evaluations: bool = True) -> dict[str, str] | None:
        """Why the run ends now before ``train.steps`` (the windows ran out in time order,
        ``train.epochs`` reached, or with ``evaluations`` early stopping), or None."""
        if self.time_order is not None:
            ended = self.time_order.ended(self.steps.data_position())
            return self.time_order.ending(self.step) if ended else None
        done = epochs_done(self.tc, self.passes_done, self.step)
        if done is not None or not evaluations:
            return done
        return early_stop(self.tc, ne_history(self.eval_history, self.schema.tasks), self.step)

    def _warn_if_overfitting(self) -> None:
        if self.time_order is not None:
            return  # each evaluation is of a new window: a rise is drift, not overfitting
        message = overfitting_warning(
            self.tc, ne_history(self.eval_history, self.schema.tasks), self.step)
        if message is not None:
            self.warnings.append(message)
            if self.ctx.is_main:
                log.warning("%s", message)

    def _summary(self, peak: float, start_step: int, wall_s: float) -> dict[str, Any]:
        return {
            "run": run_record(self.config, self.ctx, step=self.step, resumed_from=start_step,
                              ending=self.ending, data_passes=self.passes_done, wall_s=wall_s),
            **evaluation_summary(self.run_dir.path, self.eval_history, self.schema.tasks,
                                 step=self.step, time_order=self.time_order,
                                 windows_trained=(self._windows_trained()
                                                  if self.time_order is not None else None)),
            "warnings": self.warnings,
            "eval_history": self.eval_history,
            **self.accounting.summary(steps=self.step, peak=peak, guard=self.guard.report()),
            "checkpoints": self.checkpointer.report(),
            **self._part_reports(),
            "config": unstructure(self.config),
        }


def _gather_objects(obj: Any, ctx: ParallelContext) -> list[Any]:
    if not ctx.is_distributed:
        return [obj]
    import torch.distributed as dist

    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def _rounded_ne(report: dict[str, Any], tasks: Sequence[str]) -> dict[str, float | None]:
    """Each task's NE of an evaluation report, rounded for the log."""
    return {t: round(v, 4) if (v := report[t]["ne"]) is not None else None for t in tasks}
