"""A self-contained HTML page: the summary table and the plots inlined as PNG data."""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

from gem_core.report.runs import RunRecord

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; }
td, th { border: 1px solid #ccc; padding: 4px 10px; text-align: right; }
th { background: #f3f3f3; } td:first-child, th:first-child { text-align: left; }
figure { display: inline-block; margin: 0.5em; } img { max-width: 640px; }
"""


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(str(value))


def _rows(pairs: list[tuple[str, Any]]) -> str:
    return "".join(f"<tr><td>{html.escape(k)}</td><td>{_fmt(v)}</td></tr>" for k, v in pairs)


def summary_rows(run: RunRecord) -> list[tuple[str, Any]]:
    s = run.summary
    rows: list[tuple[str, Any]] = [("steps", s["run"]["steps"]),
                                   ("world size", s["run"]["world_size"])]
    for task, report in s["eval"].items():
        rows += [(f"{task} NE", report["ne"]), (f"{task} AUC", report["auc"]),
                 (f"{task} calibration", report["calibration"])]
        if report.get("gauc_users"):
            rows.append((f"{task} GAUC", report["gauc"]))
    rows += [("impressions/s", s["throughput"]["samples_per_s"]),
             ("requests/s", s["throughput"].get("requests_per_s")),
             ("tokens/s", s["throughput"]["tokens_per_s"]),
             ("FLOPs per step", s["flops"]["per_step"]),
             ("padding saved (attention)", s["padding_saved"]["attention"]),
             ("local MFU", s["mfu"]["local"]), ("scaling ratio", s["mfu"]["scaling_ratio"])]
    return rows


def write_report(run: RunRecord, plots: dict[str, Path], path: Path) -> Path:
    figures = []
    for name, png in plots.items():
        data = base64.b64encode(png.read_bytes()).decode()
        figures.append(f'<figure><img alt="{name}" src="data:image/png;base64,{data}">'
                       f"<figcaption>{name}</figcaption></figure>")
    backends = [(kind, f"{b['name']} ({b['package']} {b['version']}): {b['reason']}")
                for kind, b in run.summary.get("backends", {}).items()]
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>GEM run "
            f"{html.escape(run.label)}</title><style>{_STYLE}</style></head><body>"
            f"<h1>GEM run {html.escape(run.label)}</h1>"
            f"<h2>Summary</h2><table>{_rows(summary_rows(run))}</table>"
            f"<h2>Plots</h2>{''.join(figures)}"
            f"<h2>Backends</h2><table>{_rows(backends)}</table>"
            # Lets a headless browser test read how many plots actually decoded and rendered.
            "<script>window.addEventListener('load', () => { document.body.dataset."
            "plotsRendered = [...document.images].filter(i => i.naturalWidth > 0).length; });"
            "</script></body></html>")
    path.write_text(page)
    return path
