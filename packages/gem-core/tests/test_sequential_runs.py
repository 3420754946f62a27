"""``gem_core.testing.sequential_runs`` refuses a runs file it cannot read, naming the file and the
run, before it joins any process group (its runs are exercised by gem-parallel's MoE tests)."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from gem_core.testing.sequential_runs import main


@pytest.mark.parametrize(("runs", "message"), [
    ([], "expected a non-empty JSON list of runs"),
    ({"out": "x", "preset": "tiny"}, "expected a non-empty JSON list of runs"),
    ([{"out": "a", "preset": "tiny"}, {"preset": "tiny"}], r"run 1 needs 'out' and 'preset'"),
    ([{"out": "a", "preset": "tiny", "steps": 3}], r"got keys \['out', 'preset', 'steps'\]"),
])
def test_bad_runs_file_is_refused_naming_file_and_run(tmp_path, monkeypatch, runs, message):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    path = tmp_path / "runs.json"
    path.write_text(json.dumps(runs))
    with pytest.raises(ValueError, match=message) as refused:
        main([str(path)])
    assert str(path) in str(refused.value)
    assert not dist.is_initialized()


def test_usage_without_one_file():
    with pytest.raises(SystemExit, match="usage: python -m gem_core.testing.sequential_runs"):
        main([])
