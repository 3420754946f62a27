"""The README's five-minute tour runs as written."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def tour_commands() -> list[list[str]]:
    text = README.read_text()
    section = text.split("## A five-minute tour", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands = []
    for line in block.splitlines():
        words = shlex.split(line, comments=True)
        if words and words[0] == "gem":
            commands.append(words[1:])
        elif words:
            assert words[0] == "source", f"unexpected tour line: {line}"
    return commands


@pytest.mark.slow
def test_every_tour_command_succeeds(gem, tmp_path):
    commands = tour_commands()
    assert len(commands) >= 8
    for args in commands:
        result = gem("--log-level", "WARNING", *args, cwd=tmp_path)
        assert result.returncode == 0, f"gem {' '.join(args)} failed:\n{result.stderr[-3000:]}"
    resumed = json.loads((tmp_path / "runs" / "tour" / "summary.json").read_text())
    assert resumed["run"]["resumed_from"] == 20 and resumed["run"]["steps"] == 30
    assert (tmp_path / "runs" / "tour" / "report" / "index.html").exists()
    assert json.loads((tmp_path / "runs" / "fsdp" / "summary.json").read_text())["run"][
        "world_size"] == 2
