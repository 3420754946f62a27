"""The documentation that is generated from code is current."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_cli_reference_is_generated_from_the_current_commands():
    result = subprocess.run([sys.executable, str(REPO / "tools" / "gen_cli_docs.py"), "--check"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def test_extending_tables_are_generated_from_the_registry():
    result = subprocess.run([sys.executable, str(REPO / "tools" / "gen_extending_docs.py"),
                             "--check"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
