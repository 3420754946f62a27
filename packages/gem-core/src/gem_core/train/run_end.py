"""When an epoch-based run ends before ``train.steps``, and when it warns of overfitting: rules
on the evaluation history, kept out of the training loop. Every figure is the one checkpoints
are ranked by (:func:`gem_core.train.evaluate.selection_ne`)."""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

from gem_core.config import TrainConfig
from gem_core.train.evaluate import selection_ne

log = logging.getLogger(__name__)


def ne_history(history: Sequence[Mapping[str, Any]],
               tasks: Sequence[str]) -> list[tuple[int, float]]:
    """``(step, NE)`` of each evaluated step with a defined NE; a step evaluated twice (after a
    resharded resume) counts once."""
    by_step = {e["step"]: selection_ne(e, tasks) for e in history}
    return [(step, ne) for step, ne in by_step.items() if ne is not None]


def epochs_done(train: TrainConfig, passes: int | None, step: int) -> dict[str, str] | None:
    """The ending once ``train.epochs`` passes are done before ``train.steps``, else None (a
    pass that ends at ``train.steps`` itself is an ordinary end at the steps)."""
    if not (train.epochs and passes is not None and passes >= train.epochs
            and step < train.steps):
        return None
    # One pass is the default: say so, and how to train on, since a user who only set
    # train.steps may not expect the run to end before it.
    default = (" (the default: one pass; train.epochs = 0 lets train.steps decide)"
               if train.epochs == 1 else "")
    return {"reason": "epochs",
            "message": f"stopped at step {step}: train.epochs = {train.epochs} "
                       f"pass{'es' if train.epochs > 1 else ''} over the training data done "
                       f"(before train.steps = {train.steps}){default}"}


def log_epochs_plan(train: TrainConfig, source: str, passes: int | None, *,
                    time_order: bool, schedule_steps: int | None = None) -> None:
    """The start-up line on ``train.epochs``: that the run ends after its passes (a stream with
    passes), and at which step they end where the data knows (``schedule_steps`` below
    ``train.steps``: the learning-rate schedule ends there too), or a warning that a value
    above 1 is ignored (generated data, which has none). The default, 1, on generated data is
    no mistake and is not warned about."""
    if time_order or not train.epochs:
        return  # time order is one pass by construction; 0: train.steps alone decides
    if passes is None:
        if train.epochs > 1:
            log.warning("train.epochs = %d is ignored: data source %r has no passes (its "
                        "batches are generated on demand); train.steps decides", train.epochs,
                        source)
        return
    log.info("train.epochs = %d: the run ends after %s over the training data, or at "
             "train.steps = %d if that comes first (train.epochs = 0: train.steps alone "
             "decides)", train.epochs,
             "one pass" if train.epochs == 1 else f"{train.epochs} passes", train.steps)
    if schedule_steps is not None and schedule_steps < train.steps:
        log.info("the passes end at step %d: the learning-rate schedule decays to its end "
                 "there, not at train.steps = %d", schedule_steps, train.steps)


def early_stop(train: TrainConfig, history: list[tuple[int, float]],
               step: int) -> dict[str, str] | None:
    """The ending once the NE has not improved for ``train.early_stopping_patience``
    evaluations, else None."""
    patience = train.early_stopping_patience
    if not (patience and history):
        return None
    best_at = min(range(len(history)), key=lambda i: (history[i][1], i))
    since = len(history) - 1 - best_at
    if since < patience:
        return None
    best_step, ne = history[best_at]
    return {"reason": "early_stopping",
            "message": f"early stopping at step {step}: the eval NE has not improved for "
                       f"{since} evaluations (train.early_stopping_patience = {patience}); the "
                       f"best was {ne:.4f} at step {best_step}, now {history[-1][1]:.4f}"}


def overfitting_warning(train: TrainConfig, history: list[tuple[int, float]],
                        step: int) -> str | None:
    """The warning, once per streak, when the NE has risen ``train.overfit_warn_evals`` times
    in a row up to the evaluation of ``step``; else None."""
    n = train.overfit_warn_evals
    if not n or len(history) < n + 1 or history[-1][0] != step:
        return None
    recent = history[-(n + 2):]
    rises = [b[1] > a[1] for a, b in zip(recent, recent[1:])]
    if not all(rises[-n:]) or (len(rises) > n and rises[0]):
        return None  # not (just) n rises in a row: warned already when the streak reached n
    shown = ", ".join(f"{ne:.4f} at step {at}" for at, ne in history[-(n + 1):])
    best_step, best_ne = min(history, key=lambda x: x[1])
    return (f"eval NE has risen for {n} evaluations in a row ({shown}): the model is "
            f"overfitting (a second pass over the data often does this). The best so far is "
            f"{best_ne:.4f} at step {best_step}; gem export-model and the other readers use the "
            "best checkpoint. Train fewer passes (train.epochs = 1, fewer train.steps), stop "
            "early (train.early_stopping_patience), or lower train.lr")
