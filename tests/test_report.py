"""`gem report` plots and HTML page (checked in headless Chromium), `gem runs compare`."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess

import pytest

PLOTS = {"loss", "ne", "throughput", "mfu", "padding"}  # one rank: no per-rank balance plot


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_run, gem):
    """Two 1-rank runs of SMALL_RUN (6 steps): ``softmax``, a copy of the session's run trained
    in one go; ``silu`` with another seed (so other generated data), stopped at step 2 and
    resumed."""
    from gem_core.testing.runs import SMALL_RUN

    root = tmp_path_factory.mktemp("runs")
    softmax, silu = root / "softmax", root / "silu"
    shutil.copytree(small_run, softmax)
    for part in (["--until-step", "2"], []):
        done = gem("--log-level", "WARNING", "train", "--out", str(silu), *SMALL_RUN,
                   "--set", "model.normalization=silu", "--set", "train.seed=1", *part)
        assert done.returncode == 0, done.stderr[-3000:]
    return [softmax, silu]


def _invoke(command, *args: str):
    """A report command in this process (no interpreter start-up per call)."""
    from click.testing import CliRunner

    result = CliRunner().invoke(command, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def test_report_writes_every_plot_and_a_self_contained_page(runs):
    from gem_core.cli.report import report
    from gem_core.report.plots import PLOT_CAPTIONS, padding_saved_per_step
    from gem_core.report.runs import read_run

    _invoke(report, runs[0])
    folder = runs[0] / "report"
    for name in PLOTS:
        png = (folder / f"{name}.png").read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 5000, name
    assert not (folder / "balance.png").exists()
    page = (folder / "index.html").read_text()
    assert re.findall(r'<img alt="(\w+)"[^>]* src="data:image/png;base64,', page) == [
        "loss", "ne", "throughput", "mfu", "padding"]
    # Captions read as sentences, not as the plots' keys.
    assert re.findall(r"<figcaption>([^<]*)</figcaption>", page) == [
        html.escape(PLOT_CAPTIONS[name]) for name in ("loss", "ne", "throughput", "mfu", "padding")]
    assert "click NE" in page and "conversion AUC" in page and "None" not in page
    assert "in one go" in page
    # The resolved config, as dotted keys.
    config = page[page.index("<h2>Configuration</h2>"):]
    assert "<td>model.normalization</td><td>softmax</td>" in config
    assert "<td>train.steps</td><td>6</td>" in config
    # The padding plot draws the same quantities as the table: over the steps, its per-step
    # shares weigh up to the summary's figure for the whole run.
    run = read_run(runs[0])
    for spent, padded, key in (("flops", "padded_flops", "total"),
                               ("attention_flops", "padded_attention_flops", "attention")):
        steps, shares = padding_saved_per_step(run.metrics, spent, padded)
        assert steps == [1, 2, 3, 4, 5, 6] and len(set(shares)) > 1
        whole = 1 - (sum(r[spent] for r in run.metrics) / sum(r[padded] for r in run.metrics))
        assert whole == pytest.approx(run.summary["padding_saved"][key], rel=1e-9)
        assert min(shares) <= whole <= max(shares)
    assert run.summary["padding_saved"]["attention"] > run.summary["padding_saved"]["total"]


def test_report_marks_a_resume(runs, tmp_path):
    from gem_core.cli.report import report

    _invoke(report, runs[1], "--out", tmp_path)
    page = (tmp_path / "index.html").read_text()
    assert "Resumed from the checkpoint of step 2 and trained to step 6" in page
    assert "<td>model.normalization</td><td>silu</td>" in page


def test_report_renders_in_headless_chromium(runs, tmp_path):
    from gem_core.cli.report import report

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("Debian's chromium is not installed (make test installs it where apt-get "
                    "works); the page itself is checked without a browser above")
    _invoke(report, runs[0])
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


def test_runs_compare_puts_runs_side_by_side(runs, tmp_path):
    from gem_core.cli.report import runs as runs_group

    plot = tmp_path / "compare.png"
    result = _invoke(runs_group, "compare", *runs, "--plot", plot, "--json")
    answer = json.loads(result.stdout)
    table = answer["runs"]
    assert set(table) == {"softmax", "silu"}
    for row in table.values():
        assert row["steps"] == 6 and row["click NE"] > 0
    assert answer["config_differences"] == {
        "model.normalization": {"softmax": "softmax", "silu": "silu"},
        "train.seed": {"softmax": 0, "silu": 1}}
    assert plot.read_bytes().startswith(b"\x89PNG")
    text = _invoke(runs_group, "compare", *runs)
    assert "click NE" in text.stdout and "softmax" in text.stdout
    assert "None" not in text.stdout
    assert "scaling ratio" in text.stdout  # 1.0 for these one-rank runs, n/a with several
    differences = text.stdout[text.stdout.index("config differences:"):].splitlines()
    assert [line.split() for line in differences[2:]] == [
        ["model.normalization", "softmax", "silu"], ["train.seed", "0", "1"]]
    # Another seed generates other data: said on stderr, naming what differs.
    assert "warning: silu was trained on other data than softmax: seed: 0 -> 1" in text.stderr


def test_runs_compare_shows_missing_figures_as_not_available(runs, tmp_path):
    """A multi-rank run has no measured scaling ratio (null in summary.json): n/a, not None."""
    from gem_core.cli.report import runs as runs_group

    copy = tmp_path / "two-ranks"
    shutil.copytree(runs[0], copy, ignore=shutil.ignore_patterns("checkpoints", "report"))
    summary = json.loads((copy / "summary.json").read_text())
    summary["mfu"]["scaling_ratio"] = None
    (copy / "summary.json").write_text(json.dumps(summary))
    text = _invoke(runs_group, "compare", runs[0], copy)
    (row,) = [line.split() for line in text.stdout.splitlines()
              if line.startswith("scaling ratio")]
    assert row[-2:] == ["1", "n/a"]
    assert "config differences: none" in text.stdout
    assert "cannot tell whether the data is the same (two-ranks kept no checkpoint)" in text.stderr


def test_report_of_something_that_is_not_a_run_is_a_clear_error(tmp_path):
    from click.testing import CliRunner

    from gem_core.cli.report import report
    from gem_core.errors import GemConfigError

    with pytest.raises(GemConfigError, match="is not a finished run directory"):
        CliRunner().invoke(report, [str(tmp_path)], catch_exceptions=False)
