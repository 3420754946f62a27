"""Reading a run directory back: metrics, evaluations, summary.

Through the trainer's own readers (:func:`gem_core.train.run_dir.read_records`,
:func:`~gem_core.train.run_dir.read_summary`): a damaged line of a log is skipped with a
warning naming the file and line; a damaged ``summary.json`` is an error naming it; an
unreadable checkpoint only loses the data comparison, with a warning."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import attrs

from gem_core.checkpoint.checkpointer import read_trainer_state
from gem_core.checkpoint.layout import complete_checkpoints
from gem_core.errors import GemConfigError, GemError
from gem_core.train.data_fingerprint import STATE_KEY as FINGERPRINT_KEY
from gem_core.train.data_fingerprint import fingerprint_differences
from gem_core.train.run_dir import read_records, read_summary

log = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class RunRecord:
    """What a run directory says about its run, read back by :func:`read_run`."""

    path: Path
    """The run directory."""
    metrics: list[dict[str, Any]]
    """``metrics.jsonl``: one record per logged training step."""
    evals: list[dict[str, Any]]
    """``eval.jsonl``: one record per evaluation."""
    summary: dict[str, Any]
    """``summary.json``, written at the end of the run (or of its last part)."""
    data_fingerprint: dict[str, Any] | None
    """What data the newest complete checkpoint was trained on
    (:mod:`gem_core.train.data_fingerprint`); None when the run kept no checkpoint."""

    @property
    def tasks(self) -> list[str]:
        return list(self.summary.get("eval", {}))

    @property
    def label(self) -> str:
        return self.path.name

    @property
    def resumed_from(self) -> int:
        """The step the last part of the run resumed from (0: it ran in one go)."""
        step = self.summary["run"].get("resumed_from")
        return step if type(step) is int else 0

    @property
    def config(self) -> dict[str, Any]:
        """The resolved config as dotted keys (``train.steps``), lists and empty tables whole."""
        config = self.summary.get("config")
        return flatten(config) if isinstance(config, dict) else {}


def flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` as ``{"a.b": 1}``; an empty table stays a value (``{}``)."""
    flat: dict[str, Any] = {}
    for key, value in table.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def config_differences(runs: list[RunRecord]) -> dict[str, list[Any]]:
    """Dotted config keys whose value is not the same in every run, with each run's value
    (``None`` where a run's config lacks the key); ``name`` is left out (runs differ by it)."""
    configs = [run.config for run in runs]
    keys = sorted({key for config in configs for key in config} - {"name"})
    return {key: [config.get(key) for config in configs] for key in keys
            if any(config.get(key) != configs[0].get(key) for config in configs[1:])}


def data_differences(runs: list[RunRecord]) -> list[str]:
    """One line per run whose training data differs from the first run's (by the data
    fingerprints of their newest checkpoints: source, options, seed, content digest), naming
    the fields that differ; runs without a checkpoint are compared by nothing and named."""
    first = runs[0]
    lines = []
    for run in runs[1:]:
        if first.data_fingerprint is None or run.data_fingerprint is None:
            missing = [r.label for r in (first, run) if r.data_fingerprint is None]
            lines.append(f"{run.label} vs {first.label}: cannot tell whether the data is the "
                         f"same ({', '.join(missing)} kept no checkpoint)")
            continue
        changed = fingerprint_differences(first.data_fingerprint, run.data_fingerprint)
        if changed:
            lines.append(f"{run.label} was trained on other data than {first.label}: "
                         + "; ".join(changed))
    return lines


def _json_lines(path: Path) -> list[dict[str, Any]]:
    """The records of a log; damaged lines are skipped, each with a warning."""
    if not path.is_file():
        return []
    return [record for _, record in read_records(path, strict=False)]


def read_run(path: str | Path) -> RunRecord:
    """A finished (or stopped) run; a directory without summary.json, or with a damaged one,
    is an error naming it."""
    path = Path(path)
    summary_file = path / "summary.json"
    if not summary_file.exists():
        raise GemConfigError(f"{path} is not a finished run directory: {summary_file} is missing")
    return RunRecord(path=path, metrics=_json_lines(path / "metrics.jsonl"),
                     evals=_json_lines(path / "eval.jsonl"), summary=read_summary(path),
                     data_fingerprint=_newest_data_fingerprint(path))


def _newest_data_fingerprint(path: Path) -> dict[str, Any] | None:
    """What data the newest complete checkpoint was trained on; None (with a warning when it
    cannot be read) where that is not known."""
    checkpoints = complete_checkpoints(path)
    if not checkpoints:
        return None
    try:
        fingerprint = read_trainer_state(checkpoints[-1][1]).get(FINGERPRINT_KEY)
    except (GemError, OSError) as error:
        log.warning("the data of %s is not compared: its newest checkpoint does not read (%s)",
                    path, error)
        return None
    return fingerprint if isinstance(fingerprint, dict) else None
