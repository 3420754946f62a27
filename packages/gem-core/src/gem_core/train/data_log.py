"""The data source's counts of checked, dropped and repaired requests, in the log.

A source that validates its data (gem-data's ``parquet`` source) counts what its policies
dropped or repaired; those counts belong in the log, where a user watching a run sees them, not
only in ``summary.json``. The trainer logs them after every evaluation and at the end of the run.
"""

from __future__ import annotations

import logging
from typing import Any

from gem_core.contracts import DataSource

log = logging.getLogger(__name__)


def data_report(source: DataSource) -> dict[str, Any]:
    """``source.report()``: the counts for the summary (``{}`` by the contract's default)."""
    return source.report()


def data_counts_line(report: dict[str, Any]) -> str | None:
    """One line of the counts in ``report`` (``rows_checked``, ``rows_dropped`` and
    ``rows_repaired`` per check, ``histories_truncated``), or None when it holds none."""
    if "rows_checked" not in report:
        return None
    parts = [f"{report['rows_checked']} requests checked"]
    for key, verb in (("rows_dropped", "dropped"), ("rows_repaired", "repaired")):
        counts = report.get(key) or {}
        total = sum(counts.values())
        detail = ", ".join(f"{check} {count}" for check, count in counts.items() if count)
        parts.append(f"{total} {verb}" + (f" ({detail})" if detail else ""))
    if report.get("histories_truncated"):
        parts.append(f"{report['histories_truncated']} histories cut to max_seq_len")
    return ", ".join(parts)


def log_data_counts(source: DataSource, when: str) -> None:
    """Log the source's counts (this rank's reads) ``when`` (e.g. "at step 40")."""
    report = data_report(source)
    line = data_counts_line(report)
    if line is None:
        return
    changed = sum((report.get("rows_dropped") or {}).values()) + sum(
        (report.get("rows_repaired") or {}).values())
    # Dropped or repaired requests are a warning: the run trains on less or altered data.
    log.log(logging.WARNING if changed else logging.INFO, "data %s: %s", when, line)
