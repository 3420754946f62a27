"""Helpers for the cross-package tests: run ``gem`` as a user would, in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_gem(*args: str, env: dict[str, str] | None = None, timeout: float = 600,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m gem_core.cli.main ARGS`` with this interpreter; never raises on exit code."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "gem_core.cli.main", *args], env=full_env,
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)


@pytest.fixture(scope="session")
def gem():
    return run_gem


@pytest.fixture(scope="session")
def small_run(tmp_path_factory, gem) -> Path:
    """``gem_core.testing.runs.SMALL_RUN`` trained once in one process; read only (a test that
    trains it further copies it first)."""
    from gem_core.testing.runs import SMALL_RUN

    out = tmp_path_factory.mktemp("small-run") / "run"
    result = gem("train", "--out", str(out), *SMALL_RUN)
    assert result.returncode == 0, result.stderr[-3000:]
    return out
