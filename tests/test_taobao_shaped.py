"""``tools/taobao_shaped.py``: a small Taobao-shaped world goes through the real ``gem data
import``, and ``measure`` joins every eval impression to its known click probability (and
stops, naming the impression, when truth.csv lacks its row or holds it twice)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from gem_data.importer import import_command
from gem_data.manifest import read_manifest


@pytest.fixture(scope="module")
def tool(tools):
    return tools("taobao_shaped")


@pytest.fixture(scope="module")
def world(tool, tmp_path_factory) -> tuple[Path, Path]:
    """A small world and its import (the command ``gem data import`` runs)."""
    raw, data = tmp_path_factory.mktemp("taobao") / "raw", tmp_path_factory.mktemp("d") / "data"
    tool.main(["generate", "--out", str(raw), "--users", "100", "--days", "2", "--seed", "3"])
    result = CliRunner().invoke(import_command, [
        "--impressions", str(raw / "raw_sample.csv"), "--events", str(raw / "behavior_log.csv"),
        "--schema", str(raw / "taobao.toml"), "--out", str(data)])
    assert result.exit_code == 0, result.output
    return raw, data


def test_every_eval_impression_joins_and_the_figures_read_right(tool, world, tmp_path, capsys):
    raw, data = world
    figures = tmp_path / "figures.json"
    tool.main(["measure", "--raw", str(raw), "--data", str(data), "--json", str(figures)])
    printed = capsys.readouterr().out
    result = json.loads(figures.read_text())
    imported = sum(entry.candidates for entry in read_manifest(data).splits["eval"])
    assert result["eval_impressions"] == imported > 0
    assert f"eval_impressions: {imported}" in printed
    assert all(math.isfinite(value) for value in result.values())
    assert result["achievable_ne"] < result["base_rate_ne"]
    assert 0 < result["eval_engaged"] <= result["eval_impressions"]
    assert 0 <= result["eval_engaged_beyond_256"] <= result["eval_engaged"]


@pytest.mark.parametrize("change, what", [("remove", "no row"), ("repeat", "more than one row")])
def test_measure_stops_naming_an_impression_without_exactly_one_truth_row(
        tool, world, tmp_path, change, what):
    raw, data = world
    first = tool.imported_impressions(data, "eval").slice(0, 1).to_pylist()[0]
    key = ",".join(str(first[name]) for name in tool.KEY) + ","
    lines = (raw / "truth.csv").read_text().splitlines(keepends=True)
    (row,) = [line for line in lines if line.startswith(key)]
    changed = tmp_path / "raw"
    shutil.copytree(raw, changed)
    (changed / "truth.csv").write_text("".join(
        lines + [row] if change == "repeat" else [line for line in lines if line != row]))
    with pytest.raises(tool.TruthJoinError, match=rf"eval split\): 1 of \d+ impressions have "
                                                  rf"{what} in truth.csv, e.g. .*"
                                                  rf"'adgroup_id': {first['adgroup_id']}"):
        tool.measure(changed, data)
