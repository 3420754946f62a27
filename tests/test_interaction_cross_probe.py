"""``tools/interaction_cross_probe.py`` runs end to end on the ``cross`` kind (a few steps)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("layout", [
    ["--interaction", "wukong"],
    ["--interaction", "cross", "--layout", "model", "--dense", "per_feature", "--clip", "1.0",
     "--trainer-rates", "--token-norm", "rms", "--loud-tokens", "1"],
])
def test_the_probe_trains_and_reports_the_parity_floor(layout):
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "interaction_cross_probe.py"), *layout,
         "--steps", "4", "--eval-every", "2", "--noise-tokens", "2"],
        capture_output=True, text=True, check=True, timeout=300).stdout
    floor = float(re.search(r"the parity alone reaches eval NE ([0-9.]+)", out).group(1))
    assert 0.5 < floor < 0.99  # the parity is worth something on its own
    steps = re.findall(r"step (\d+): eval NE ([0-9.]+), mean prediction odd ([0-9.]+), "
                       r"even ([0-9.]+)", out)
    assert [int(s[0]) for s in steps] == [2, 4]
