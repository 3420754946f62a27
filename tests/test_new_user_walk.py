"""A new user's first hour, scripted: the README tour's commands, run as a user would run them.

The commands are read from the README's tour block (the one source). By default each keeps its
shape and shrinks its size (a tenth of the steps and data, small batches and evaluation) to fit
the test budget; ``GEM_WALK_FULL=1`` runs them exactly as written and also checks that every run
ends with the meaningful figures the README quotes (NE below 1, AUC above 0.7 on both tasks).
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
FULL = os.environ.get("GEM_WALK_FULL") == "1"
# Appended to every `gem train` outside GEM_WALK_FULL=1.
SMALL_TRAIN = ["--set", "train.batch_size=32", "--set", "train.eval_batch_size=256"]
SHRINK = 10


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


def shrunk(args: list[str]) -> list[str]:
    """The same command with a tenth of its steps and rows, and small batches and evaluation."""
    out = []
    for previous, word in zip([""] + args, args):
        steps = re.fullmatch(r"train\.steps=(\d+)", word)
        if steps:
            word = f"train.steps={max(2, int(steps.group(1)) // SHRINK)}"
        elif previous in ("--rows", "--eval-rows"):
            word = str(int(word) // SHRINK)
        out.append(word)
    if args[0] == "train":
        out += SMALL_TRAIN
        if "--data" not in args:  # the synthetic source draws its evaluation rows itself
            out += ["--set", "data.eval_rows=256"]
    return out


def _steps(args: list[str]) -> int:
    return next(int(m.group(1)) for a in args if (m := re.fullmatch(r"train\.steps=(\d+)", a)))


def _out(args: list[str]) -> str:
    return args[args.index("--out") + 1]


@pytest.mark.slow
def test_the_readme_tour_runs_and_leaves_its_outputs(gem, tmp_path):
    commands = [args if FULL else shrunk(args) for args in tour_commands()]
    assert len(commands) >= 8
    outputs = {}
    for args in commands:
        result = gem("--log-level", "WARNING", *args, cwd=tmp_path)
        assert result.returncode == 0, f"gem {' '.join(args)} failed:\n{result.stderr[-3000:]}"
        outputs[args[0], args[1] if len(args) > 1 else ""] = result.stdout

    trains = [args for args in commands if args[0] == "train"]
    # the second run into the same directory resumes where the first stopped
    tour = [args for args in trains if _out(args) == "runs/tour"]
    assert len(tour) == 2
    summary = json.loads((tmp_path / "runs/tour/summary.json").read_text())
    assert summary["run"]["resumed_from"] == _steps(tour[0])
    assert summary["run"]["steps"] == _steps(tour[1])
    for name in ("metrics.jsonl", "eval.jsonl", "config.toml", "tensorboard", "checkpoints"):
        assert (tmp_path / "runs/tour" / name).exists(), name
    assert (tmp_path / "runs/tour/report/index.html").stat().st_size > 1000
    compared = outputs["runs", "compare"]
    assert "click NE" in compared and "silu" in compared, compared
    silu = json.loads((tmp_path / "runs/silu/summary.json").read_text())
    assert silu["backends"]["attention"]["name"] == "blocked"
    assert silu["config"]["model"]["normalization"] == "silu"
    fsdp = json.loads((tmp_path / "runs/fsdp/summary.json").read_text())
    assert fsdp["run"]["world_size"] == 2
    assert list((tmp_path / "data/ads").rglob("*.parquet"))

    last_train_into = {_out(args): args for args in trains}
    for out, args in last_train_into.items():
        run = json.loads((tmp_path / out / "summary.json").read_text())
        assert run["run"]["finished"] and run["run"]["steps"] == _steps(args), out
        if FULL:  # past warm-up: the figures the README quotes
            for task, metrics in run["eval"].items():
                assert metrics["ne"] < 1.0 and metrics["auc"] > 0.7, (out, task, metrics)
