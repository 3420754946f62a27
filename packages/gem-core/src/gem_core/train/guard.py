"""Deciding, identically on every rank, whether an optimizer step is safe to take."""

from __future__ import annotations

import math
from collections import Counter, deque
from typing import Any

from gem_core.config import TrainConfig

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
            self.recent.append(loss)
        else:
            self.consecutive_bad += 1
            self.reasons[reason.split(" (")[0]] += 1

    @property
    def must_roll_back(self) -> bool:
        return self.max_consecutive > 0 and self.consecutive_bad >= self.max_consecutive

    def report(self) -> dict[str, Any]:
        return {"skipped_steps": sum(self.reasons.values()), "reasons": dict(self.reasons),
                "rollbacks": self.rollbacks}

    def state_dict(self) -> dict[str, Any]:
        return {"recent": list(self.recent), "consecutive_bad": self.consecutive_bad,
                "reasons": dict(self.reasons), "rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.recent.clear()
        self.recent.extend(state["recent"])
        self.consecutive_bad = state["consecutive_bad"]
        self.reasons = Counter(state["reasons"])
        self.rollbacks = state["rollbacks"]
