"""Reading a run directory back: metrics, evaluations, summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from gem_core.checkpoint import complete_checkpoints
from gem_core.errors import GemConfigError
from gem_core.train.checkpointer import read_trainer_state
from gem_core.train.data_fingerprint import STATE_KEY as FINGERPRINT_KEY
from gem_core.train.data_fingerprint import fingerprint_differences


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
        return int(self.summary["run"].get("resumed_from") or 0)

    @property
    def config(self) -> dict[str, Any]:
        """The resolved config as dotted keys (``train.steps``), lists and empty tables whole."""
        return flatten(self.summary.get("config", {}))


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
    if not path.exists():
        return []
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise GemConfigError(f"{path}, line {number}: not JSON ({error})") from None
    return records


def read_run(path: str | Path) -> RunRecord:
    """A finished (or stopped) run; a directory without summary.json is an error naming it."""
    path = Path(path)
    summary_file = path / "summary.json"
    if not summary_file.exists():
        raise GemConfigError(f"{path} is not a finished run directory: {summary_file} is missing")
    return RunRecord(path=path, metrics=_json_lines(path / "metrics.jsonl"),
                     evals=_json_lines(path / "eval.jsonl"),
                     summary=json.loads(summary_file.read_text()),
                     data_fingerprint=_newest_data_fingerprint(path))


def _newest_data_fingerprint(path: Path) -> dict[str, Any] | None:
    checkpoints = complete_checkpoints(path)
    if not checkpoints:
        return None
    return read_trainer_state(checkpoints[-1][1]).get(FINGERPRINT_KEY)
