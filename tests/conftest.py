"""Helpers for the cross-package tests: run ``gem`` as a user would, in a subprocess; load a
script of ``tools/`` as a module."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gem_core.testing.processes import run_process_group

REPO = Path(__file__).resolve().parents[1]


def run_gem(*args: str, env: dict[str, str] | None = None, timeout: float = 600,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m gem_core.cli.main ARGS`` with this interpreter; never raises on exit code.
    Past ``timeout`` it raises, with the stacks of every gem process of the command (launcher,
    torchrun's agent, ranks) in the message: a hang says where it was."""
    full_env = {**os.environ, **(env or {})}
    return run_process_group([sys.executable, "-m", "gem_core.cli.main", *args], env=full_env,
                             timeout=timeout, cwd=cwd, raise_on_timeout=True)


@pytest.fixture(scope="session")
def gem():
    return run_gem


def tool_module(name: str):
    """``tools/<name>.py`` as a module (its ``main`` does not run)."""
    spec = importlib.util.spec_from_file_location(f"_tool_{name}", REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tools():
    """``tools(name)``: ``tools/<name>.py`` as a module, loaded once a session."""
    loaded: dict[str, object] = {}

    def load(name: str):
        if name not in loaded:
            loaded[name] = tool_module(name)
        return loaded[name]

    return load


@pytest.fixture(scope="session")
def small_run(tmp_path_factory, gem) -> Path:
    """``gem_core.testing.runs.SMALL_RUN`` trained once in one process; read only (a test that
    trains it further copies it first)."""
    from gem_core.testing.runs import SMALL_RUN

    out = tmp_path_factory.mktemp("small-run") / "run"
    result = gem("train", "--out", str(out), *SMALL_RUN)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def small_data_set(tmp_path_factory, gem) -> Path:
    """A parquet data set of ``gem data synth``: 128 training and 128 eval requests in row
    groups of 64 (two per pass, so passes and resumes inside one are testable), 300 items (so a
    few steps can overfit); made once a session, read only."""
    out = tmp_path_factory.mktemp("small-data") / "data"
    done = gem("data", "synth", "--rows", "128", "--eval-rows", "128", "--row-group-rows", "64",
               "--out", str(out), "--set", "num_items=300")
    assert done.returncode == 0, done.stderr[-3000:]
    return out
