"""A self-contained HTML page: the summary table and the plots inlined as PNG data."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

from gem_core.report.plots import PLOT_CAPTIONS
from gem_core.report.runs import RunRecord

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; }
td, th { border: 1px solid #ccc; padding: 4px 10px; text-align: right; }
th { background: #f3f3f3; } td:first-child, th:first-child { text-align: left; }
figure { display: inline-block; margin: 0.5em; } img { max-width: 640px; }
"""


#: How a figure the run did not produce (MFU of an untimed run, the scaling ratio of a
#: multi-rank run) is shown.
NOT_AVAILABLE = "n/a"


def display(value: Any) -> str:
    """A figure or setting as a reader sees it: floats to 4 digits, lists and tables as JSON,
    a missing figure as :data:`NOT_AVAILABLE` (never Python's ``None``)."""
    if value is None:
        return NOT_AVAILABLE
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value)
    return str(value)


def _fmt(value: Any) -> str:
    return html.escape(display(value))


def _rows(pairs: list[tuple[str, Any]]) -> str:
    return "".join(f"<tr><td>{html.escape(k)}</td><td>{_fmt(v)}</td></tr>" for k, v in pairs)


def _figure(summary: dict[str, Any], table: str, key: str) -> Any:
    """``summary[table][key]``; None (shown as :data:`NOT_AVAILABLE`) where the summary has no
    such figure (another version's, or a stopped run's)."""
    values = summary.get(table)
    return values.get(key) if isinstance(values, dict) else None


def summary_rows(run: RunRecord) -> list[tuple[str, Any]]:
    s = run.summary
    rows: list[tuple[str, Any]] = [("steps", _figure(s, "run", "steps")),
                                   ("world size", _figure(s, "run", "world_size"))]
    progressive = s.get("progressive")
    if isinstance(progressive, dict):  # time order: the headline is the windows' mean
        rows.append(("windows trained", f"{progressive.get('windows_trained')} of "
                                        f"{progressive.get('windows_total')}"))
    mean = (f" (progressive, mean of {len(progressive.get('windows', ()))} windows)"
            if isinstance(progressive, dict) else "")
    for task, report in s["eval"].items():
        rows += [(f"{task} NE{mean}", report.get("ne")),
                 (f"{task} AUC{mean}", report.get("auc")),
                 (f"{task} calibration{mean}", report.get("calibration"))]
        if report.get("gauc_users"):
            rows.append((f"{task} GAUC{mean}", report.get("gauc")))
    rows += [("impressions/s", _figure(s, "throughput", "samples_per_s")),
             ("requests/s", _figure(s, "throughput", "requests_per_s")),
             ("tokens/s", _figure(s, "throughput", "tokens_per_s")),
             ("FLOPs per step", _figure(s, "flops", "per_step")),
             ("padding saved (all FLOPs)", _figure(s, "padding_saved", "total")),
             ("padding saved (attention)", _figure(s, "padding_saved", "attention")),
             ("local MFU", _figure(s, "mfu", "local")),
             ("scaling ratio", _figure(s, "mfu", "scaling_ratio"))]
    return rows


def history_text(run: RunRecord) -> str:
    """One sentence on how the run got to its last step (in one go, or resumed)."""
    steps = _figure(run.summary, "run", "steps")
    if run.resumed_from:
        return (f"Resumed from the checkpoint of step {run.resumed_from} and trained to step "
                f"{steps} (marked on the loss plot); throughput and MFU below are measured over "
                "that last part, the plots cover the whole run.")
    return f"Trained from step 0 to step {steps} in one go."


def write_report(run: RunRecord, plots: dict[str, Path], path: Path) -> Path:
    figures = []
    for name, png in plots.items():
        data = base64.b64encode(png.read_bytes()).decode()
        caption = html.escape(PLOT_CAPTIONS[name])
        figures.append(f'<figure><img alt="{name}" title="{caption}" '
                       f'src="data:image/png;base64,{data}"><figcaption>{caption}</figcaption>'
                       "</figure>")
    listed = run.summary.get("backends")
    backends = [(kind, f"{b.get('name')} ({b.get('package')} {b.get('version')}): "
                       f"{b.get('reason')}")
                for kind, b in (listed.items() if isinstance(listed, dict) else ())
                if isinstance(b, dict)]
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>GEM run "
            f"{html.escape(run.label)}</title><style>{_STYLE}</style></head><body>"
            f"<h1>GEM run {html.escape(run.label)}</h1>"
            f"<p class='history'>{html.escape(history_text(run))}</p>"
            f"<h2>Summary</h2><table>{_rows(summary_rows(run))}</table>"
            f"<h2>Plots</h2>{''.join(figures)}"
            f"<h2>Backends</h2><table>{_rows(backends)}</table>"
            f"<h2>Configuration</h2><table class='config'>{_rows(list(run.config.items()))}"
            "</table>"
            # Lets a headless browser test read how many plots actually decoded and rendered.
            "<script>window.addEventListener('load', () => { document.body.dataset."
            "plotsRendered = [...document.images].filter(i => i.naturalWidth > 0).length; });"
            "</script></body></html>")
    path.write_text(page)
    return path
