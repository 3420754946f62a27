"""docs/extending.md's example, built from the page's own code blocks: the files it shows are
written into a distribution, which joins `gem` through its entry point; `gem plugins` lists it, a
short `gem train` uses it, its own conformance test passes, and what the page says about its
`auto` answer and its start-up error is what happens."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "extending.md"

# A fenced block whose info string names the file it is: ```python title="my_package/plugin.py"
TITLED_BLOCK = re.compile(r'^```(?P<lang>\w+) title="(?P<path>[^"]+)"\n(?P<body>.*?)^```$',
                          re.MULTILINE | re.DOTALL)
PYTHON_BLOCK = re.compile(r"^```python[^\n]*\n(?P<body>.*?)^```$", re.MULTILINE | re.DOTALL)

QUICK_RUN = ("--set", "train.steps=3", "--set", "train.batch_size=32", "--set",
             "data.eval_rows=128", "--set", "train.eval_batch_size=128", "--set",
             "train.warmup_steps=1", "--no-progress")


def page_files() -> dict[str, str]:
    """``{relative path: text}`` of every titled block of the page."""
    files = {m["path"]: m["body"] for m in TITLED_BLOCK.finditer(PAGE.read_text())}
    assert len(files) == len(TITLED_BLOCK.findall(PAGE.read_text())), "a path is titled twice"
    return files


def write_distribution(root: Path) -> dict:
    """Write the page's files under ``root`` and make ``root`` an installed distribution the way
    an editable install does: importable from a path entry, with a ``.dist-info`` whose entry
    points are the ``[project.entry-points.gem]`` table of the page's pyproject.toml."""
    files = page_files()
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    project = tomllib.loads(files["pyproject.toml"])["project"]
    info = root / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    entry_points = "".join(f"{name} = {target}\n"
                           for name, target in project["entry-points"]["gem"].items())
    (info / "entry_points.txt").write_text(f"[gem]\n{entry_points}")
    return project


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """The distribution's directory, its ``[project]`` table and an environment that sees it."""
    root = tmp_path_factory.mktemp("my-gem-attention")
    project = write_distribution(root)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH"))
                                         if p)}
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(root))
        yield root, project, env
    for name in [n for n in sys.modules if n == "my_package" or n.startswith("my_package.")]:
        del sys.modules[name]


def test_every_python_block_of_the_page_compiles():
    blocks = [m["body"] for m in PYTHON_BLOCK.finditer(PAGE.read_text())]
    assert len(blocks) >= 5
    for number, body in enumerate(blocks):
        compile(body, f"{PAGE.name} python block {number}", "exec")


def test_the_page_shows_a_whole_distribution():
    assert {"pyproject.toml", "my_package/__init__.py", "my_package/plugin.py",
            "my_package/attention.py", "tests/test_my_attention.py"} <= set(page_files())


def test_gem_plugins_lists_the_example(gem, example):
    _, project, env = example
    result = gem("plugins", "--json", env=env)
    assert result.returncode == 0, result.stderr
    table = json.loads(result.stdout)
    assert [f for f in table["failed_plugins"] if f["plugin"] == "my_plugin"] == []
    row = {r["name"]: r for r in table["kinds"]["attention"]}["my-sdpa"]
    assert (row["package"], row["version"], row["plugin"]) == (project["name"],
                                                              project["version"], "my_plugin")
    assert row["capabilities"] == ["softmax"] and row["status"] == "ok"


def test_a_short_train_uses_the_example(gem, example, tmp_path):
    _, project, env = example
    result = gem("train", "--attention", "my-sdpa", "--out", str(tmp_path / "run"), *QUICK_RUN,
                 env=env)
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    chosen = summary["backends"]["attention"]
    assert (chosen["name"], chosen["package"]) == ("my-sdpa", project["name"])
    losses = [json.loads(line)["loss"]
              for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(loss > 0 for loss in losses)


def test_the_example_passes_its_own_conformance_test(example):
    """The page's test module, run by pytest in the distribution's directory as a plugin author
    would (the repository's conftest files are not on that path)."""
    root, _, env = example
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/test_my_attention.py", "-q",
         "-p", "no:cacheprovider", "-rs"],
        cwd=root, env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "failed" not in summary, summary
    # What the page says is skipped (the relative-bias comparisons), and nothing else.
    skipped = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
    assert skipped and all("relative_bias" in line for line in skipped), skipped


def test_auto_answers_as_the_page_says(example):
    """On a GPU the example answers `auto`, but gem-kernels (asked first: `gem_kernels` sorts
    before `my_plugin`) answers before it; on a CPU it passes."""
    from gem_core.plugins import build_plugins
    from gem_core.registry import AutoContext

    plugins = build_plugins(disabled=())
    order = plugins.default_answerers("attention")
    assert order[-1] == "gem_core" and order.index("gem_kernels") < order.index("my_plugin")
    gpu, cpu = AutoContext(device="cuda"), AutoContext(device="cpu")
    alone = build_plugins(disabled=("gem_kernels",))
    assert alone.default_for("attention", gpu) == ("my-sdpa",
                                                    "my-sdpa: fused SDPA kernels on the GPU")
    assert alone.default_for("attention", cpu)[0] != "my-sdpa"
    first = "triton" if importlib.util.find_spec("triton") is not None else "my-sdpa"
    assert plugins.default_for("attention", gpu)[0] == first


def test_a_silu_model_is_refused_at_start_up_with_the_pages_message(example):
    from gem_core.config import load_config
    from gem_core.distributed import ParallelContext
    from gem_core.errors import GemConfigError
    from gem_core.plugins import build_plugins
    from gem_core.train.backends import resolve_backends

    page = PAGE.read_text()
    shown = page.split("$ gem train --attention my-sdpa --set model.normalization=silu\n")[1]
    shown = " ".join(shown.split("```")[0].split())
    config = load_config(preset="tiny", overrides=("backends.attention=my-sdpa",
                                                   "model.normalization=silu"))
    with pytest.raises(GemConfigError) as refused:
        resolve_backends(config, build_plugins(disabled=()), ParallelContext())
    assert shown == f"Error: {refused.value}"
