"""tools/gpu_check.sh runs end to end as a CPU dry run (interpreted kernels, tiny sizes), so the
script a GPU session runs blind has at least run here."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "tools" / "gpu_check.sh"


def test_gpu_check_dry_run_on_cpu(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_DEVICE="cpu", GPU_CHECK_SIZE="tiny",
               OUT=str(tmp_path))
    out = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    last = out.stdout.strip().splitlines()
    assert last[-1].startswith("pma ")  # the table is printed last
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["correct_cases"] == report["total_cases"] > 0
    assert {"self_causal", "cross", "pma"} <= set(report["bench"])
