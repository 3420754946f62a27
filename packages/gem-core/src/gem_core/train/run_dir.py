"""The run directory contract: metrics.jsonl, eval.jsonl, summary.json, config.toml,
checkpoints/."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Any

from gem_core.config import GemConfig, to_toml, unstructure
from gem_core.errors import GemConfigError, GemRunError
from gem_core.train.environment import write_errors_named

log = logging.getLogger(__name__)

#: What a run writes besides its checkpoints; ``--fresh`` deletes them all.
RUN_OUTPUTS = ("metrics.jsonl", "eval.jsonl", "summary.json", "summary.json.tmp", "config.toml")
TENSORBOARD_DIR = "tensorboard"
#: A training step that ends with an evaluation carries its figures in metrics.jsonl as
#: ``eval_<figure>_<task>`` columns; TensorBoard has them once, as ``eval/<task>/<figure>``.
EVALUATION_COLUMN_PREFIX = "eval_"
EVALUATION_COLUMN_FIGURES = ("ne", "auc", "calibration")


def evaluation_columns(entry: dict[str, Any]) -> dict[str, float]:
    """The ``eval_<figure>_<task>`` columns of an evaluation entry (``{"step", task: report}``)
    that the step's metrics record carries."""
    return {f"{EVALUATION_COLUMN_PREFIX}{figure}_{task}": value
            for task, report in entry.items() if isinstance(report, dict)  # not step, window
            for figure, value in report.items() if figure in EVALUATION_COLUMN_FIGURES}


def _clean(value: Any) -> Any:
    """JSON has no NaN or infinity: write them as null rather than invalid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def tensorboard_writer_class(mode: str, *, announce: bool) -> Any:
    """``SummaryWriter`` for ``train.tensorboard = mode``, or ``None`` when no events are to be
    written: ``off``, or ``auto`` where ``torch.utils.tensorboard`` does not import (the
    ``tensorboard`` package is an optional dependency), which one INFO line says with the
    reason when ``announce`` (rank 0). ``on`` raises a GemConfigError when it does not import."""
    if mode == "off":
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        if mode == "on":
            raise GemConfigError(
                f"train.tensorboard is 'on' but torch.utils.tensorboard does not import "
                f"({error}); install TensorBoard (pip install 'gem-core[tensorboard]') or set "
                "train.tensorboard to 'auto' (events when it imports) or 'off'") from None
        if announce:
            log.info("TensorBoard events are not written: torch.utils.tensorboard does not "
                     "import (%s); pip install 'gem-core[tensorboard]' to get them, or set "
                     "train.tensorboard = 'off'. metrics.jsonl and eval.jsonl have every "
                     "figure", error)
        return None
    return SummaryWriter


class RunDirectory:
    """Writes the run directory; only rank 0 writes (``enabled``). TensorBoard event files go to
    ``tensorboard/`` next to the JSON lines, with the same scalars, as ``tensorboard`` says
    (``train.tensorboard``: see :func:`tensorboard_writer_class`, called here at start-up on
    every rank, so ``on`` without TensorBoard stops every rank alike)."""

    def __init__(self, path: Path, *, enabled: bool, tensorboard: str = "auto") -> None:
        self.path = Path(path)
        self.enabled = enabled
        self._writer = None
        self._writer_class = (tensorboard_writer_class(tensorboard, announce=enabled)
                              if enabled or tensorboard == "on" else None)
        if enabled:
            self.path.mkdir(parents=True, exist_ok=True)

    def start_fresh(self) -> None:
        """``--fresh`` (rank 0, holding the run's lock): delete the checkpoints and every file
        of the earlier run (logs, summary, TensorBoard events), so no old row or curve point
        is mixed into the new run's."""
        if not self.enabled:
            return
        with write_errors_named("the run directory (--fresh)", self.path):
            for directory in ("checkpoints", TENSORBOARD_DIR):
                if (self.path / directory).exists():
                    shutil.rmtree(self.path / directory)
            for name in RUN_OUTPUTS:
                (self.path / name).unlink(missing_ok=True)

    def open_tensorboard(self, *, first_step: int) -> None:
        """Start the event writer; events after ``first_step`` left by an earlier, interrupted
        run (every event when starting at step 0 without a checkpoint) are purged, so a
        resumed run's curves have no doubled tail."""
        if self.enabled and self._writer is None and self._writer_class is not None:
            with write_errors_named("TensorBoard events", self.path / TENSORBOARD_DIR):
                self._writer = self._writer_class(str(self.path / TENSORBOARD_DIR),
                                                  purge_step=first_step + 1)

    def _scalars(self, prefix: str, record: dict[str, Any], step: int) -> None:
        if self._writer is None:
            return
        for key, value in record.items():
            if isinstance(value, dict):
                self._scalars(f"{prefix}/{key}", value, step)
            elif isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                if math.isfinite(value):
                    with write_errors_named("TensorBoard events", self.path / TENSORBOARD_DIR):
                        self._writer.add_scalar(f"{prefix}/{key}", value, step)

    def close(self) -> None:
        if self._writer is not None:
            with write_errors_named("TensorBoard events", self.path / TENSORBOARD_DIR):
                self._writer.close()
            self._writer = None

    def write_config(self, config: GemConfig) -> None:
        if self.enabled:
            with write_errors_named("config.toml", self.path / "config.toml"):
                (self.path / "config.toml").write_text(to_toml(unstructure(config)))

    def _append(self, name: str, record: dict[str, Any]) -> None:
        if self.enabled:
            with write_errors_named(name, self.path / name):
                with open(self.path / name, "a") as handle:
                    _write_line(handle, json.dumps(_clean(record)) + "\n")

    def append_metrics(self, record: dict[str, Any]) -> None:
        self._append("metrics.jsonl", record)
        # The evaluation columns are written by append_eval, under eval/: not twice.
        self._scalars("train", {key: value for key, value in record.items()
                                if not key.startswith(EVALUATION_COLUMN_PREFIX)}, record["step"])

    def append_eval(self, record: dict[str, Any]) -> None:
        self._append("eval.jsonl", record)
        self._scalars("eval", record, record["step"])

    def truncate_metrics(self, *, after_step: int, evaluations: list[dict[str, Any]] | None = None
                         ) -> None:
        """On resume, forget lines logged after the checkpoint (they will be logged again). With
        ``evaluations`` (the checkpoint's eval history), evaluations logged at the checkpoint's
        own step after it was saved (a time window evaluated on resume) are forgotten too. A
        torn last line (the process died mid-write) is dropped with a warning; an unreadable
        line before the last is an error naming the file and line."""
        if not self.enabled:
            return
        saved_at_step = sum(1 for e in evaluations or () if e.get("step") == after_step)
        for name in ("metrics.jsonl", "eval.jsonl"):
            file = self.path / name
            if not file.exists():
                continue
            records = read_records(file)
            kept = [line for line, record in records if record["step"] <= after_step]
            if name == "eval.jsonl" and evaluations is not None:
                at_step = [line for line, record in records if record["step"] == after_step]
                kept = [line for line, record in records if record["step"] < after_step]
                kept += at_step[:saved_at_step]
            with write_errors_named(name, file):
                temporary = file.with_name(file.name + ".tmp")
                temporary.write_text("".join(line + "\n" for line in kept))
                os.replace(temporary, file)

    def write_summary(self, summary: dict[str, Any]) -> None:
        if self.enabled:
            temporary = self.path / "summary.json.tmp"
            with write_errors_named("summary.json", temporary):
                temporary.write_text(json.dumps(_clean(summary), indent=2) + "\n")
                os.replace(temporary, self.path / "summary.json")


def _write_line(handle: Any, text: str) -> None:
    """One whole line, flushed (a test makes this raise ENOSPC, as a full disk does)."""
    handle.write(text)
    handle.flush()


def read_records(file: Path, *, strict: bool = True) -> list[tuple[str, dict[str, Any]]]:
    """``(line, record)`` of every line of a JSON-lines log of the run (``metrics.jsonl``,
    ``eval.jsonl``): the one reader of them, for the trainer and for ``gem report``.

    A line that is not a JSON object with an integer ``step`` (torn by an interrupted write,
    not UTF-8, not JSON) is dropped with a warning naming the file, the line and its bytes when
    it is the last line (the process died mid-write), or wherever it is when not ``strict``
    (readers that only show the run). ``strict`` (the trainer, which rewrites the file on
    resume): such a line before the last is an error naming the file and line."""
    lines = Path(file).read_bytes().split(b"\n")
    records = []
    for number, raw in enumerate(lines, start=1):
        if not raw:
            continue
        last = number == len(lines) or (number == len(lines) - 1 and not lines[-1])
        try:
            line = raw.decode("utf-8")
            record = json.loads(line)
            if not isinstance(record, dict) or type(record.get("step")) is not int:
                raise ValueError("not a record with an integer step")
        except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
            if last:
                log.warning("%s: dropped its last line, torn by an interrupted write (%d bytes: "
                            "%.60r...)", file, len(raw), raw)
                continue
            if not strict:
                log.warning("%s line %d: skipped, not a JSON record with a step (%s; %d bytes: "
                            "%.60r...)", file, number, _reason(error), len(raw), raw)
                continue
            raise GemRunError(f"{file} line {number} is not a JSON record with a step "
                              f"({_reason(error)}); only the last line can be torn by an "
                              "interrupted write. Delete the line, or use --fresh to start the "
                              "run over") from None
        records.append((line, record))
    return records


def read_summary(run_dir: Path) -> dict[str, Any]:
    """``summary.json`` of a run directory (which must exist): a damaged or foreign one (not
    UTF-8, not JSON, truncated, not a summary with ``run`` and ``eval`` tables) is a
    GemRunError naming the file."""
    file = Path(run_dir) / "summary.json"
    try:
        summary = json.loads(file.read_bytes())
    except (ValueError, RecursionError) as error:
        raise GemRunError(f"{file} is damaged ({_reason(error)}): truncated or overwritten; the "
                          "trainer writes it again at the end of the run's next `gem train`"
                          ) from None
    if not (isinstance(summary, dict) and isinstance(summary.get("run"), dict)
            and isinstance(summary.get("eval"), dict)
            and all(isinstance(task, dict) for task in summary["eval"].values())):
        raise GemRunError(f"{file} is not the summary of a GEM run: it needs a JSON object with "
                          "'run' and 'eval' tables")
    return summary


def _reason(error: BaseException) -> str:
    """One line of a JSON reader's error."""
    if isinstance(error, UnicodeDecodeError):
        return f"not UTF-8: byte {error.object[error.start:error.start + 1]!r} at {error.start}"
    if isinstance(error, RecursionError):
        return "nested too deeply"
    return str(error).splitlines()[0] if str(error) else type(error).__name__
