"""The run directory contract: metrics.jsonl, eval.jsonl, summary.json, config.toml, checkpoints/."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from gem_core.config import GemConfig, to_toml, unstructure


def _clean(value: Any) -> Any:
    """JSON has no NaN or infinity: write them as null rather than invalid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class RunDirectory:
    """Writes the run directory; only rank 0 writes (``enabled``). TensorBoard event files go to
    ``tensorboard/`` next to the JSON lines, with the same scalars."""

    def __init__(self, path: Path, *, enabled: bool) -> None:
        self.path = Path(path)
        self.enabled = enabled
        self._writer = None
        if enabled:
            self.path.mkdir(parents=True, exist_ok=True)

    def open_tensorboard(self, *, first_step: int) -> None:
        """Start the event writer; events at or after ``first_step`` left by an earlier,
        interrupted run are purged so a resumed run's curves have no doubled tail."""
        if self.enabled and self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.path / "tensorboard"),
                                         purge_step=first_step + 1 if first_step else None)

    def _scalars(self, prefix: str, record: dict[str, Any], step: int) -> None:
        if self._writer is None:
            return
        for key, value in record.items():
            if isinstance(value, dict):
                self._scalars(f"{prefix}/{key}", value, step)
            elif isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                if math.isfinite(value):
                    self._writer.add_scalar(f"{prefix}/{key}", value, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def write_config(self, config: GemConfig) -> None:
        if self.enabled:
            (self.path / "config.toml").write_text(to_toml(unstructure(config)))

    def _append(self, name: str, record: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path / name, "a") as handle:
                handle.write(json.dumps(_clean(record)) + "\n")

    def append_metrics(self, record: dict[str, Any]) -> None:
        self._append("metrics.jsonl", record)
        self._scalars("train", record, record["step"])

    def append_eval(self, record: dict[str, Any]) -> None:
        self._append("eval.jsonl", record)
        self._scalars("eval", record, record["step"])

    def truncate_metrics(self, *, after_step: int) -> None:
        """On resume, forget lines logged after the checkpoint (they will be logged again)."""
        if not self.enabled:
            return
        for name in ("metrics.jsonl", "eval.jsonl"):
            file = self.path / name
            if not file.exists():
                continue
            kept = [line for line in file.read_text().splitlines()
                    if line and json.loads(line)["step"] <= after_step]
            file.write_text("".join(line + "\n" for line in kept))

    def write_summary(self, summary: dict[str, Any]) -> None:
        if self.enabled:
            temporary = self.path / "summary.json.tmp"
            temporary.write_text(json.dumps(_clean(summary), indent=2) + "\n")
            os.replace(temporary, self.path / "summary.json")
