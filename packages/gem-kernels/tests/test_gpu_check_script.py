"""tools/gpu_check.sh runs end to end as a CPU dry run (interpreted kernels, tiny sizes; the E2E
section trains tiny eager bf16 and validates every other planned configuration), so the script
a GPU session runs blind has at least run here."""

import json
import os
import subprocess
import sys
from pathlib import Path

from gem_kernels.bench import gpu_e2e

SCRIPT = Path(__file__).resolve().parents[3] / "tools" / "gpu_check.sh"


def test_gpu_check_dry_run_on_cpu(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_DEVICE="cpu", GPU_CHECK_SIZE="tiny",
               OUT=str(tmp_path))
    out = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-1] == "gpu_check: all sections passed"
    assert any(line.startswith("pma ") for line in lines)  # the kernel table
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["correct_cases"] == report["total_cases"] > 0
    assert {"self_causal", "cross", "pma"} <= set(report["bench"])
    e2e = json.loads((tmp_path / "gpu_e2e.json").read_text())
    assert not e2e["failed"]
    trained = e2e["runs"]["tiny/eager/bf16"]
    assert trained["samples_per_s"] > 0 and trained["local_mfu"] > 0 and trained["ne"]
    assert trained["backends"]["embedding"] == e2e["embedding"]
    planned = {f"tiny/{mode}/{precision}" for mode in gpu_e2e.MODES
               for precision in gpu_e2e.PRECISIONS}
    assert set(e2e["runs"]) == planned
    assert all("validated only" in e2e["runs"][name]["skipped"]
               for name in planned - {"tiny/eager/bf16"})
    assert "e2e tiny/eager/bf16:" in out.stdout


def test_a_bad_e2e_run_fails_alone_and_is_named(tmp_path, capsys):
    """Every planned run names an embedding backend nobody registered: each run fails on its
    own (recorded, named), none stops the others, and the section's status is 1."""
    args = ["run", "--size", "tiny", "--device", "cpu", "--embedding", "no-such-backend",
            "--out", str(tmp_path / "e2e.json"), "--workdir", str(tmp_path / "runs")]
    assert gpu_e2e.main(args) == 1
    report = json.loads((tmp_path / "e2e.json").read_text())
    assert len(report["failed"]) == len(report["runs"]) == 6
    assert all("no-such-backend" in row["error"] for row in report["runs"].values())
    assert "FAIL e2e tiny/eager/bf16: invalid configuration" in capsys.readouterr().err


def test_full_plan_covers_both_presets_modes_and_precisions():
    runs = gpu_e2e.plan("full", "cuda", "fbgemm-tbe")
    assert {(r["preset"], r["mode"], r["precision"]) for r in runs} == {
        (p, m, q) for p in ("small", "large") for m in gpu_e2e.MODES
        for q in gpu_e2e.PRECISIONS}
    assert all(r["runnable"] and "backends.embedding=fbgemm-tbe" in r["overrides"]
               for r in runs)
    assert runs[0]["name"] == "small/eager/bf16" and runs[1]["name"] == "large/eager/bf16"
    plugins = gpu_e2e.build_run_plugins()
    for run in runs:  # every GPU configuration loads and names registered backends
        gpu_e2e.validate(run, plugins)
