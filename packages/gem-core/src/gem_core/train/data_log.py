"""The data source's counts of checked, dropped and repaired requests, in the log.

A source that validates its data (gem-data's ``parquet`` source) counts what its policies
dropped or repaired; those counts belong in the log, where a user watching a run sees them, not
only in ``summary.json``. The trainer logs them after every evaluation and at the end of the run.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from gem_core.contracts import DataSource, WindowedSource

if TYPE_CHECKING:
    from gem_core.batch import JaggedBatch

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


class CountedRequests:
    """``batches`` passed through, counting their requests: every rank iterates every eval
    batch (each computes its share), so the count is the evaluation's."""

    def __init__(self, batches: Iterable[JaggedBatch]) -> None:
        self.batches, self.requests = batches, 0

    def __iter__(self) -> Iterator[JaggedBatch]:
        for batch in self.batches:
            self.requests += batch.batch_size
            yield batch


def evaluated_line(counted: CountedRequests, eval_rows: int | None, source: DataSource,
                   window: int | None) -> str:
    """How many requests an evaluation scored, and why that many: the whole eval split (or
    time window ``window``), or ``data.eval_rows`` of the split's requests (where the source
    says how many it has; generated data does not)."""
    requests = counted.requests
    if eval_rows is None:
        return f"evaluated {requests} requests (the whole eval split)"
    split_rows = _eval_split_rows(source, window)
    if split_rows is None:
        return f"evaluated {requests} requests (data.eval_rows = {eval_rows})"
    whole = "the whole eval split; " if eval_rows >= split_rows else ""
    return f"evaluated {requests} requests ({whole}data.eval_rows = {eval_rows} of {split_rows})"


def _eval_split_rows(source: DataSource, window: int | None) -> int | None:
    """Requests in the eval split (``window``: in that time window of a windowed source), as
    far as the source says."""
    if window is not None and isinstance(source, WindowedSource):
        return source.windows()[window].rows
    rows = data_report(source).get("eval_split_rows")
    return rows if isinstance(rows, int) else None
