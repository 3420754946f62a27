"""``gem runs seeds``: runs grouped into configurations repeated over seeds, each compared with
the first seed by seed (gem_core.report.seeds)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from click.testing import CliRunner

from gem_core.cli.report import runs
from gem_core.config import load_config, unstructure
from gem_core.errors import GemConfigError
from gem_core.report.runs import read_run
from gem_core.report.seeds import seed_arms

# NE of each arm's run per seed: the seeds move both arms together (0.93, 0.94, 0.95), the
# option gains 0.002, 0.001 and 0.003 on them.
BASE = {0: 0.9312, 1: 0.9415, 2: 0.9508}
GAIN = {0: 0.002, 1: 0.001, 2: 0.003}


def _run(root: Path, name: str, seed: int, ne: float, *overrides: str,
         drop: tuple[str, str] | None = None) -> Path:
    config = unstructure(load_config(preset="tiny", overrides=[
        f"train.seed={seed}", f"data.path=logs/s{seed}", *overrides]))
    if drop is not None:  # as a version before the key wrote it
        del config[drop[0]][drop[1]]
    path = root / name
    path.mkdir()
    (path / "summary.json").write_text(json.dumps({
        "run": {"steps": 10}, "config": config,
        "eval": {"click": {"ne": ne, "auc": 1.5 - ne, "gauc": 1.4 - ne}}}))
    return path


@pytest.fixture()
def two_arms(tmp_path) -> list[Path]:
    base = [_run(tmp_path, f"base-{s}", s, ne) for s, ne in BASE.items()]
    option = [_run(tmp_path, f"bias-{s}", s, BASE[s] - GAIN[s], 'model.id_bias=["item"]')
              for s in (2, 0, 1)]  # any order
    return base + option


def test_arms_are_compared_seed_by_seed(two_arms):
    first, second = seed_arms([read_run(p) for p in two_arms])
    assert first.label == "baseline" and second.label == 'model.id_bias=["item"]'
    assert first.figures["click.ne"].mean == pytest.approx(statistics.mean(BASE.values()))
    assert first.figures["click.ne"].sd == pytest.approx(statistics.stdev(BASE.values()))
    paired = second.paired["click.ne"]
    assert paired.count == 3
    assert paired.mean == pytest.approx(-statistics.mean(GAIN.values()))
    assert paired.sd == pytest.approx(statistics.stdev(GAIN.values()))
    # The seeds' spread (0.01) is far larger than the paired differences' (0.001).
    assert second.figures["click.ne"].sd > 5 * paired.sd
    assert second.better == {"click.ne": 3, "click.auc": 3, "click.gauc": 3}
    assert not first.paired


def test_the_command_prints_and_writes_json(two_arms):
    result = CliRunner().invoke(runs, ["seeds", *map(str, two_arms)])
    assert result.exit_code == 0, result.output
    assert "arm 2: model.id_bias=[\"item\"] (3 runs" in result.output
    assert "paired -0.0020 ± 0.0010, better on 3 of 3" in result.output
    result = CliRunner().invoke(runs, ["seeds", "--json", *map(str, two_arms)])
    arms = json.loads(result.output)["arms"]
    assert [arm["better_on"]["click.ne"] for arm in arms[1:]] == [3]
    assert arms[1]["paired_difference"]["click.ne"]["count"] == 3


def test_last_compares_each_runs_last_evaluation(tmp_path):
    """``--last``: the figures of ``eval_last`` (the model as training left it) where a run
    chose an earlier checkpoint for ``eval``; a run without ``eval_last`` reports ``eval``."""
    paths = [_run(tmp_path, f"run-{s}", s, ne) for s, ne in BASE.items()]
    for seed, path in zip(BASE, paths[:2]):
        summary = json.loads((path / "summary.json").read_text())
        summary["eval_last"] = {"click": {"ne": BASE[seed] + 0.01, "auc": 0.5, "gauc": 0.5}}
        (path / "summary.json").write_text(json.dumps(summary))
    (reported,) = seed_arms([read_run(p) for p in paths])
    (last,) = seed_arms([read_run(p) for p in paths], last=True)
    assert reported.figures["click.ne"].mean == pytest.approx(statistics.mean(BASE.values()))
    assert last.figures["click.ne"].mean == pytest.approx(
        statistics.mean(BASE.values()) + 0.02 / 3)
    result = CliRunner().invoke(runs, ["seeds", "--last", *map(str, paths)])
    assert result.exit_code == 0, result.output
    assert f"click.ne      {statistics.mean(BASE.values()) + 0.02 / 3:.4f}" in result.output


def test_a_run_written_before_a_key_joins_the_arm_that_behaves_as_it_did(tmp_path):
    """A configuration without ``model.id_bias_step`` was trained with constant steps: it is
    the arm of runs that name ``constant``, not of today's default."""
    old = _run(tmp_path, "old", 0, 0.93, drop=("model", "id_bias_step"))
    constant = _run(tmp_path, "constant", 1, 0.94, "model.id_bias_step=constant")
    today = _run(tmp_path, "today", 2, 0.95)
    arms = seed_arms([read_run(p) for p in (old, constant, today)])
    assert [sorted(r.label for r in arm.runs.values()) for arm in arms] == [
        ["constant", "old"], ["today"]]
    assert arms[1].label == 'model.id_bias_step="fisher"' and not arms[1].paired


def test_ignored_keys_and_repeated_seeds(tmp_path):
    a = _run(tmp_path, "a", 0, 0.93)
    b = _run(tmp_path, "b", 1, 0.94, "train.eval_every=50")
    assert len(seed_arms([read_run(a), read_run(b)])) == 2
    (arm,) = seed_arms([read_run(a), read_run(b)], ignored_keys=["train.eval_every"])
    assert len(arm.runs) == 2
    again = _run(tmp_path, "again", 0, 0.95)
    with pytest.raises(GemConfigError, match=r"a and .*again have the same configuration"):
        seed_arms([read_run(a), read_run(again)])


def test_long_task_names_keep_the_figures_in_one_column(tmp_path):
    """A task name such as ``conversion`` makes figure names longer than the usual column
    (``conversion.gauc``): every figure still starts in the same column, apart from its name."""
    for seed, ne in BASE.items():
        path = _run(tmp_path, f"two-{seed}", seed, ne)
        summary = json.loads((path / "summary.json").read_text())
        summary["eval"]["conversion"] = {"ne": ne - 0.1, "auc": 0.8, "gauc": 0.79}
        (path / "summary.json").write_text(json.dumps(summary))
    result = CliRunner().invoke(runs, ["seeds", *map(str, sorted(tmp_path.iterdir()))])
    assert result.exit_code == 0, result.output
    figures = [line for line in result.output.splitlines() if " ± " in line]
    assert len(figures) == 6 and any("conversion.gauc" in line for line in figures)
    assert len({line.index(" ± ") for line in figures}) == 1
    assert all(float(line.split()[1]) > 0 for line in figures)  # the name, then the mean


def test_runs_the_first_arm_did_not_run_are_named_unpaired(tmp_path):
    """Five option runs against three baseline seeds: the paired difference is over three, and
    the two the baseline lacks, with the baseline seed the option lacks, are named, not silently
    left out of the pairing."""
    base = [_run(tmp_path, f"base-{s}", s, BASE[s]) for s in (0, 1, 2)]
    option = [_run(tmp_path, f"bias-{s}", s, 0.93, 'model.id_bias=["item"]') for s in (1, 2, 3, 4)]
    first, second = seed_arms([read_run(p) for p in base + option])
    assert not first.unpaired and not first.missing
    assert second.paired["click.ne"].count == 2 and second.figures["click.ne"].count == 4
    assert sorted(r.label for r in second.unpaired.values()) == ["bias-3", "bias-4"]
    assert second.missing == (('0', '"logs/s0"'),)
    result = CliRunner().invoke(runs, ["seeds", *map(str, base + option)])
    assert result.exit_code == 0, result.output
    assert 'unpaired: bias-3 (train.seed=3, data.path="logs/s3"): arm 1 has no run' in result.output
    assert 'missing: arm 1\'s train.seed=0, data.path="logs/s0" (no run here)' in result.output
    arms = json.loads(CliRunner().invoke(runs, ["seeds", "--json", *map(str, base + option)])
                      .output)["arms"]
    assert [Path(p).name for p in arms[1]["unpaired_runs"]] == ["bias-3", "bias-4"]
    assert arms[1]["missing_seeds"] == [{"train.seed": 0, "data.path": "logs/s0"}]
    assert arms[0]["unpaired_runs"] == [] and arms[0]["missing_seeds"] == []
