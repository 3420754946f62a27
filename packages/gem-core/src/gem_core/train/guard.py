"""Deciding, identically on every rank, whether an optimizer step is safe to take."""

from __future__ import annotations

import math
from collections import Counter, deque
from typing import Any

from gem_core.config import TrainConfig
from gem_core.errors import GemRunError

MIN_HISTORY = 10  # good steps needed before a spike can be judged against their mean


class StepGuard:
    """Skips steps whose loss or gradient norm is not finite, or whose loss spikes above
    ``spike_factor`` x the mean of the last ``spike_window`` good losses. It sees only values
    already reduced across ranks, so every rank reaches the same verdict without another
    collective."""

    def __init__(self, config: TrainConfig) -> None:
        self.skip_nonfinite = config.skip_nonfinite
        self.spike_factor = config.spike_factor
        self.max_consecutive = config.max_bad_steps
        self.recent: deque[float] = deque(maxlen=config.spike_window)
        self.consecutive_bad = 0
        self.reasons: Counter[str] = Counter()
        self.rollbacks = 0
        self.max_rollbacks = config.max_rollbacks
        self.streak_reasons: Counter[str] = Counter()  # of the current run of bad steps
        # Rollbacks in a row without the run getting past the steps where the previous one
        # failed: a persistent fault fails at about the same step after every rollback, and
        # this list is what the run stops with.
        self.rollbacks_without_progress: list[dict[str, Any]] = []

    def verdict(self, loss: float, grad_norm: float) -> str | None:
        """Why this step must be skipped, or None to take it."""
        if self.skip_nonfinite and not math.isfinite(loss):
            return "non-finite loss"
        if self.skip_nonfinite and not math.isfinite(grad_norm):
            return "non-finite gradient norm"
        if self.spike_factor > 0 and len(self.recent) >= MIN_HISTORY:
            mean = sum(self.recent) / len(self.recent)
            if loss > self.spike_factor * mean:
                return f"loss spike ({loss:.4g} > {self.spike_factor:g} x mean {mean:.4g})"
        return None

    def record(self, loss: float, reason: str | None) -> None:
        if reason is None:
            self.consecutive_bad = 0
            self.streak_reasons.clear()
            self.recent.append(loss)
        else:
            self.consecutive_bad += 1
            self.reasons[reason.split(" (")[0]] += 1
            self.streak_reasons[reason.split(" (")[0]] += 1

    @property
    def must_roll_back(self) -> bool:
        return self.max_consecutive > 0 and self.consecutive_bad >= self.max_consecutive

    def before_rollback(self, checkpoint_step: int | None, *, last_step: int) -> dict[str, Any]:
        """Check that a rollback may happen after the bad steps ending at ``last_step`` (to the
        checkpoint of ``checkpoint_step``; None: there is none) and return what
        :meth:`after_rollback` keeps across the restore. :class:`GemRunError` with the steps and
        causes when there is no checkpoint, or when ``max_rollbacks`` rollbacks happened in a
        row without progress: every bad run of steps starting no later than the previous one
        ended (a fault that went away lets the run get past it; a persistent one does not)."""
        event = {"steps": (last_step - self.consecutive_bad + 1, last_step),
                 "causes": dict(self.streak_reasons), "to_step": checkpoint_step}
        previous = self.rollbacks_without_progress
        if previous and event["steps"][0] > previous[-1]["steps"][1]:
            self.rollbacks_without_progress = []  # got past the last failure: progress
        if checkpoint_step is None:
            raise GemRunError(
                f"{self.consecutive_bad} consecutive steps were skipped ({_describe(event)}) "
                "and there is no checkpoint to roll back to (train.checkpoint_every saves one "
                "every N steps); lower train.lr or inspect the data")
        if len(self.rollbacks_without_progress) >= self.max_rollbacks:
            history = [*self.rollbacks_without_progress, {**event, "to_step": None}]
            raise GemRunError(
                f"stopped: {self.consecutive_bad} consecutive steps were skipped again after "
                f"{len(self.rollbacks_without_progress)} rollback(s) in a row, none of which got "
                f"the run past the failing steps (train.max_rollbacks = {self.max_rollbacks}); "
                "the fault persists. "
                + "; ".join(f"{i + 1}. {_describe(e)}" for i, e in enumerate(history))
                + ". Lower train.lr, inspect the data at those steps, or raise "
                "train.max_rollbacks")
        return {"reasons": self.reasons.copy(), "rollbacks": self.rollbacks + 1,
                "rollbacks_without_progress": [*self.rollbacks_without_progress, event]}

    def after_rollback(self, kept: dict[str, Any]) -> None:
        """After the checkpoint's guard state was loaded: what went wrong since it did happen,
        so its counts (and the rollback) stay."""
        self.reasons, self.rollbacks = kept["reasons"], kept["rollbacks"]
        self.rollbacks_without_progress = kept["rollbacks_without_progress"]
        self.consecutive_bad = 0
        self.streak_reasons.clear()

    def report(self) -> dict[str, Any]:
        return {"skipped_steps": sum(self.reasons.values()), "reasons": dict(self.reasons),
                "rollbacks": self.rollbacks}

    def state_dict(self) -> dict[str, Any]:
        return {"recent": list(self.recent), "consecutive_bad": self.consecutive_bad,
                "reasons": dict(self.reasons), "rollbacks": self.rollbacks,
                "streak_reasons": dict(self.streak_reasons)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.recent.clear()
        self.recent.extend(state["recent"])
        self.consecutive_bad = state["consecutive_bad"]
        self.reasons = Counter(state["reasons"])
        self.rollbacks = state["rollbacks"]
        self.streak_reasons = Counter(state.get("streak_reasons", {}))  # absent before 2026-12


def _describe(event: dict[str, Any]) -> str:
    first, last = event["steps"]
    causes = ", ".join(f"{cause} x{count}" for cause, count in sorted(event["causes"].items()))
    where = f"steps {first}-{last}" if first != last else f"step {last}"
    target = "" if event["to_step"] is None else f", rolled back to step {event['to_step']}"
    return f"{where}: {causes}{target}"
