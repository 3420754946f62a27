"""Each package builds into its own wheel with its entry points; the dependency rules hold."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {"gem-core": "gem_core", "gem-data": "gem_data", "gem-kernels": "gem_kernels",
            "gem-parallel": "gem_parallel", "gem-precision": "gem_precision"}


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheels")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "--wheel-dir", str(out),
                    *(str(REPO / "packages" / p) for p in PACKAGES)],
                   check=True, capture_output=True, timeout=600)
    return {p: next(out.glob(f"{m}-*.whl")) for p, m in PACKAGES.items()}


@pytest.mark.parametrize("dist", list(PACKAGES))
def test_wheel_has_its_own_version_and_entry_point(wheels, dist):
    with zipfile.ZipFile(wheels[dist]) as wheel:
        names = wheel.namelist()
        entry_points = next((n for n in names if n.endswith("entry_points.txt")), None)
        text = wheel.read(entry_points).decode() if entry_points else ""
        if dist == "gem-core":
            assert "gem_core/presets/tiny.toml" in names
            assert "gem = gem_core.cli.main:main" in text
        else:
            module = PACKAGES[dist]
            assert f"[gem]\n{module} = {module}.plugin" in text


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


# Which first-party package may import which (and gem-core's layers): tests/test_layering.py.


def test_model_code_never_imports_parallelism_kernels_or_precision_libraries():
    forbidden = {"deepspeed", "triton", "torchao", "torchrec", "fbgemm_gpu"}
    model_dir = REPO / "packages" / "gem-core" / "src" / "gem_core" / "model"
    for path in model_dir.rglob("*.py"):
        text = path.read_text()
        assert not (_imports(path) & forbidden), path
        assert "torch.distributed" not in text and "fully_shard" not in text, path


@pytest.mark.slow
def test_gem_core_alone_trains_with_its_reference_backends(gem, tmp_path):
    env = {"GEM_DISABLE_PLUGINS": "gem_data,gem_kernels,gem_parallel,gem_precision"}
    result = gem("train", "--out", str(tmp_path), "--set", "train.steps=4",
                 "--set", "train.batch_size=32", "--set", "data.eval_rows=128", "--no-progress",
                 env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    import json

    backends = json.loads((tmp_path / "summary.json").read_text())["backends"]
    assert {b["package"] for b in backends.values()} == {"gem-core"}
