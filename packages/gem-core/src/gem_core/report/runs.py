"""Reading a run directory back: metrics, evaluations, summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from gem_core.errors import GemConfigError


@attrs.frozen(kw_only=True)
class RunRecord:
    path: Path
    metrics: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    summary: dict[str, Any]

    @property
    def tasks(self) -> list[str]:
        return list(self.summary.get("eval", {}))

    @property
    def label(self) -> str:
        return self.path.name


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
                     summary=json.loads(summary_file.read_text()))
