"""`gem report` plots and HTML page (checked in headless Chromium), `gem runs compare`."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

QUICK = ["--set", "train.steps=4", "--set", "train.batch_size=32", "--set", "data.eval_rows=128",
         "--set", "train.eval_batch_size=128", "--set", "train.eval_every=2",
         "--set", "train.warmup_steps=1", "--set", "data.max_seq_len=32", "--no-progress"]
PLOTS = {"loss", "ne", "throughput", "mfu", "padding", "balance"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import os
    import sys

    root = tmp_path_factory.mktemp("runs")
    made = []
    for name, extra in (("softmax", []), ("silu", ["--set", "model.normalization=silu"])):
        out = root / name
        subprocess.run([sys.executable, "-m", "gem_core.cli.main", "--log-level", "WARNING",
                        "train", "--out", str(out), *QUICK, *extra], check=True,
                       capture_output=True, env=os.environ, timeout=600)
        made.append(out)
    return made


def test_report_writes_every_plot_and_a_self_contained_page(gem, runs):
    result = gem("report", str(runs[0]))
    assert result.returncode == 0, result.stderr[-2000:]
    folder = runs[0] / "report"
    for name in PLOTS:
        png = (folder / f"{name}.png").read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 5000, name
    page = (folder / "index.html").read_text()
    assert len(re.findall(r'<img alt="(\w+)" src="data:image/png;base64,', page)) == len(PLOTS)
    assert "click NE" in page and "conversion AUC" in page


def test_report_renders_in_headless_chromium(gem, runs, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("Debian's chromium is not installed (make test installs it where apt-get "
                    "works); the page itself is checked without a browser above")
    assert gem("report", str(runs[0])).returncode == 0
    dom = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}",
         "--virtual-time-budget=5000", "--dump-dom",
         (runs[0] / "report" / "index.html").as_uri()],
        capture_output=True, text=True, timeout=120)
    rendered = re.search(r'data-plots-rendered="(\d+)"', dom.stdout)
    assert rendered, dom.stderr[-2000:]
    assert int(rendered.group(1)) == len(PLOTS)


def test_runs_compare_puts_runs_side_by_side(gem, runs, tmp_path):
    plot = tmp_path / "compare.png"
    result = gem("runs", "compare", *(str(r) for r in runs), "--plot", str(plot), "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    table = json.loads(result.stdout)["runs"]
    assert set(table) == {"softmax", "silu"}
    for row in table.values():
        assert row["steps"] == 4 and row["click NE"] > 0
    assert plot.read_bytes().startswith(b"\x89PNG")
    text = gem("runs", "compare", *(str(r) for r in runs))
    assert "click NE" in text.stdout and "softmax" in text.stdout


def test_report_of_something_that_is_not_a_run_is_a_clear_error(gem, tmp_path):
    result = gem("report", str(tmp_path))
    assert result.returncode != 0
    assert "is not a finished run directory" in result.stderr
