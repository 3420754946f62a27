"""``gem scaling``: the log-linear fit, point parsing, and a two-point sweep end to end."""

import json
import math

import pytest
from click.testing import CliRunner

from gem_core.cli.scaling import scaling
from gem_core.report.scaling import log_linear_fit, parse_point


def test_fit_recovers_a_planted_law():
    flops = [1e8, 1e9, 1e10, 1e11]
    ne = [0.95 - 0.01 * math.log10(f) for f in flops]
    fit = log_linear_fit(flops, ne)
    assert fit["slope_per_decade"] == pytest.approx(-0.01)
    assert fit["intercept"] == pytest.approx(0.95)
    assert fit["r2"] == pytest.approx(1.0)


def test_fit_needs_two_budgets():
    with pytest.raises(ValueError, match="at least two points"):
        log_linear_fit([1e9, 1e9], [0.9, 0.8])


@pytest.mark.parametrize("text", ["nameonly", ":model.num_layers=1", "a:model.num_layers"])
def test_bad_points_are_refused(text):
    with pytest.raises(ValueError, match="NAME:key=value"):
        parse_point(text)


def test_two_point_sweep_writes_table_plot_and_fit(tmp_path):
    common = ["train.steps=3", "train.batch_size=32", "train.eval_every=0",
              "data.eval_rows=256", "train.checkpoint_every=0"]
    args = [x for c in common for x in ("--set", c)]
    args += ["--point", "small:model.embedding_dim=16,model.num_layers=1,data.max_seq_len=16",
             "--point", "big:model.embedding_dim=32,model.num_layers=2,data.max_seq_len=48",
             "--out", str(tmp_path)]
    done = CliRunner().invoke(scaling, args, catch_exceptions=False)
    assert done.exit_code == 0, done.output
    report = json.loads((tmp_path / "scaling.json").read_text())
    small, big = report["points"]
    assert big["train_flops"] > 3 * small["train_flops"]
    assert set(small["ne"]) == {"click", "conversion"}
    assert (tmp_path / "scaling.png").stat().st_size > 5000
    assert "Fit: NE =" in (tmp_path / "scaling.md").read_text()
