"""Each package, installed alone with its extras, resolves to the pinned stack of `make setup`.

pip resolves (``--dry-run --report``, nothing is installed) what the README's per-package install
commands would install, one package at a time, and the resolved set is checked against the pins
of requirements/*.txt: torch's CPU build, fbgemm's CPU build and no CUDA fbgemm or CUDA
libraries (torchrec's own dependency on "fbgemm-gpu" is met by the repository's alias), and the
pinned torchrec, triton, torchao and deepspeed. The CUDA flavour is resolved against PyPI alone.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
REQUIREMENTS = REPO / "requirements"
PYPI = "https://pypi.org/simple"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
ALIAS_DIR = REQUIREMENTS / "fbgemm-gpu-cpu-alias"

# The extras each CPU resolve installs, and the pinned names that must then be in it.
CPU_INSTALLS = {
    "gem-core": ("test,tensorboard,progress", {"torch", "tensorboard", "tqdm"}),
    "gem-data": ("duckdb,spark", {"torch", "pyarrow", "duckdb", "pyspark", "py4j"}),
    "gem-kernels": ("triton,fbgemm-cpu", {"torch", "triton", "fbgemm-gpu-cpu"}),
    "gem-parallel": ("torchrec,deepspeed",
                     {"torch", "torchrec", "fbgemm-gpu-cpu", "fbgemm-gpu", "torchmetrics",
                      "deepspeed"}),
    "gem-precision": ("fp8", {"torch", "torchao"}),
}
# Extras that only the CUDA resolve exercises.
CUDA_ONLY_EXTRAS = {("gem-kernels", "fbgemm-cuda")}


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(*files: str) -> dict[str, str]:
    pins = {}
    for file in files:
        for line in (REQUIREMENTS / file).read_text().splitlines():
            match = re.match(r"([A-Za-z0-9_.-]+)==(\S+)", line.strip())
            if match:
                pins[_normalized(match.group(1))] = match.group(2)
    return pins


def _reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=10):
            return True
    except (urllib.error.URLError, TimeoutError, OSError):
        return False


def _resolve(args: list[str], env: dict[str, str] | None = None) -> dict[str, dict]:
    """pip's resolution of ``pip install ARGS`` in a fresh environment: name -> report entry."""
    report = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
         "--no-build-isolation", "--quiet", "--retries", "1", "--report", "-", *args],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert report.returncode == 0, f"pip install {' '.join(args)}:\n{report.stderr[-3000:]}"
    return {_normalized(item["metadata"]["name"]): item
            for item in json.loads(report.stdout)["install"]}


def _cpu_index_args() -> list[str]:
    """Where torch 2.13.0+cpu comes from: PyTorch's CPU index, or pip's own configuration."""
    if not _reachable(PYPI + "/torchrec/"):
        pytest.skip(f"{PYPI} cannot be reached: the install resolves need the package index")
    index = ["--extra-index-url", TORCH_CPU_INDEX] if _reachable(TORCH_CPU_INDEX + "/") else []
    probe = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps",
         "--quiet", *index, "torch==" + _pins("cpu.txt")["torch"]],
        capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        pytest.skip(f"torch's CPU build is on neither {TORCH_CPU_INDEX} (unreachable) nor any "
                    f"index pip is configured with:\n{probe.stderr[-500:]}")
    return index


def test_every_extra_of_every_package_is_resolved_here():
    for pyproject in REPO.glob("packages/*/pyproject.toml"):
        project = tomllib.loads(pyproject.read_text())["project"]
        extras, _ = CPU_INSTALLS[project["name"]]
        declared = set(project.get("optional-dependencies", {}))
        covered = {e for e in extras.split(",") if e} | {
            extra for dist, extra in CUDA_ONLY_EXTRAS if dist == project["name"]}
        assert declared == covered, f"{pyproject}: extras {declared}, resolved here {covered}"


@pytest.mark.slow
def test_each_package_alone_resolves_to_the_pinned_cpu_stack():
    index = _cpu_index_args()
    pins = _pins("stack.txt", "cpu.txt")

    def resolve(dist: str) -> dict[str, dict]:
        extras, _ = CPU_INSTALLS[dist]
        target = f"packages/{dist}[{extras}]" if extras else f"packages/{dist}"
        return _resolve([*index, "-r", "requirements/cpu.txt", "packages/gem-core", target])

    with ThreadPoolExecutor(max_workers=len(CPU_INSTALLS)) as pool:
        resolved = dict(zip(CPU_INSTALLS, pool.map(resolve, CPU_INSTALLS)))
    for dist, found in resolved.items():
        _, expected = CPU_INSTALLS[dist]
        assert expected <= found.keys(), f"{dist}: missing {expected - found.keys()}"
        versions = {name: item["metadata"]["version"] for name, item in found.items()}
        wrong = {name: (versions[name], pin) for name, pin in pins.items()
                 if name in versions and versions[name] != pin}
        assert not wrong, f"{dist} resolves off the pinned stack (found, pinned): {wrong}"
        assert versions["torch"] == "2.13.0+cpu"
        cuda = sorted(name for name in versions if name.startswith("nvidia-"))
        assert not cuda, f"{dist} pulls CUDA libraries: {cuda}"
        if "fbgemm-gpu" in found:
            alias = found["fbgemm-gpu"]
            assert alias["metadata"]["version"] == "1.8.0+cpu.alias", (
                f"{dist} resolves the CUDA fbgemm-gpu {alias['metadata']['version']}")
            assert alias["download_info"]["url"] == ALIAS_DIR.as_uri()
            assert versions["fbgemm-gpu-cpu"] == "1.8.0"


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("GEM_TEST_CUDA_RESOLVE") != "1",
                    reason="set GEM_TEST_CUDA_RESOLVE=1: resolving the CUDA flavour downloads "
                           "torch, fbgemm-gpu and the CUDA libraries (about 2 GB, 2 minutes) "
                           "because the index serves no separate wheel metadata")
def test_the_cuda_flavour_resolves_to_pypi_cuda_builds():
    if not _reachable(PYPI + "/torch/"):
        pytest.skip(f"{PYPI} cannot be reached")
    # PyPI alone, as on a machine with no local wheels: pip's configuration is left out.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    found = _resolve(["--index-url", PYPI, "-r", "requirements/cuda.txt", "packages/gem-core",
                      "packages/gem-kernels[fbgemm-cuda]", "packages/gem-parallel[torchrec]"],
                     env=env)
    versions = {name: item["metadata"]["version"] for name, item in found.items()}
    assert versions["torch"] == "2.13.0" and versions["fbgemm-gpu"] == "1.8.0"
    assert versions["torchrec"] == "1.8.0" and "fbgemm-gpu-cpu" not in versions
    assert any(name.startswith("nvidia-") for name in versions), "torch 2.13.0 is the CUDA build"
