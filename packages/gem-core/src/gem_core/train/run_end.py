"""When an epoch-based run ends before ``train.steps``, and when it warns of overfitting: rules
on the evaluation history, kept out of the training loop. Every figure is the one checkpoints
are ranked by (:func:`gem_core.train.evaluate.selection_ne`)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from gem_core.config import TrainConfig
from gem_core.train.evaluate import selection_ne


def ne_history(history: Sequence[Mapping[str, Any]],
               tasks: Sequence[str]) -> list[tuple[int, float]]:
    """``(step, NE)`` of each evaluated step with a defined NE; a step evaluated twice (after a
    resharded resume) counts once."""
    by_step = {e["step"]: selection_ne(e, tasks) for e in history}
    return [(step, ne) for step, ne in by_step.items() if ne is not None]


def epochs_done(train: TrainConfig, passes: int | None, step: int) -> dict[str, str] | None:
    """The ending once ``train.epochs`` passes are done, else None."""
    if not (train.epochs and passes is not None and passes >= train.epochs):
        return None
    return {"reason": "epochs",
            "message": f"stopped at step {step}: train.epochs = {train.epochs} "
                       f"pass{'es' if train.epochs > 1 else ''} over the training data done "
                       f"(before train.steps = {train.steps})"}


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
