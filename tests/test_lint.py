"""The repository passes ruff (the rules in the root pyproject.toml: pycodestyle, pyflakes,
import order, bugbear), so CI fails on a lint error as it does on a failing test."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_ruff_passes_on_the_whole_repository():
    if importlib.util.find_spec("ruff") is None:
        pytest.fail("ruff is part of the pinned stack (requirements/stack.txt); run make setup")
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(REPO)],
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, f"ruff check failed:\n{result.stdout}\n{result.stderr}"
