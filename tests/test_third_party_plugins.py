"""A third-party plugin installed for real (pip, entry points) joins `gem`; a broken one is
reported and is fatal only when selected."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

EXAMPLE = REPO / "examples" / "gem-example-plugin"
BROKEN = REPO / "tests" / "fixtures" / "gem-broken-plugin"

QUICK_RUN = ["--set", "train.steps=3", "--set", "train.batch_size=32",
             "--set", "data.eval_rows=128", "--set", "train.eval_batch_size=128",
             "--set", "train.warmup_steps=1", "--no-progress"]


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory):
    """Both fixture packages pip-installed into a private target directory (the test venv is
    left untouched); PYTHONPATH makes their entry points visible to `gem`."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--target", str(target), str(EXAMPLE), str(BROKEN)],
                   check=True, capture_output=True, text=True, timeout=300)
    path = os.pathsep.join(p for p in [str(target), os.environ.get("PYTHONPATH", "")] if p)
    return {"PYTHONPATH": path}


def test_gem_plugins_lists_the_third_party_backend_and_command(gem, plugin_env):
    result = gem("plugins", "--json", env=plugin_env)
    assert result.returncode == 0, result.stderr
    table = json.loads(result.stdout)
    attention = {row["name"]: row for row in table["kinds"]["attention"]}
    assert attention["example-sdpa"]["package"] == "gem-example-plugin"
    assert attention["example-sdpa"]["version"] == "0.1.0"
    assert "example" in {row["name"] for row in table["kinds"]["cli"]}
    broken = {f["plugin"]: f for f in table["failed_plugins"]}
    assert "nonexistent_accelerator_sdk" in broken["gem_broken"]["error"]
    assert broken["gem_broken"]["package"] == "gem-broken-plugin"


def test_the_installed_example_passes_its_conformance_tests(plugin_env):
    """The README's `pytest examples/gem-example-plugin/tests` with the plugin installed: the
    shared attention suite, whose undeclared-bias check needs the contract's whole signature
    and its relative_bias error."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(EXAMPLE / "tests"), "-v", "-p", "no:cacheprovider"],
        env={**os.environ, **plugin_env}, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    for check in ("test_undeclared_relative_bias_raises_naming_it",
                  "test_undeclared_capabilities_raise_naming_them", "test_self_attention"):
        assert f"{check} PASSED" in result.stdout, result.stdout[-3000:]


def test_third_party_command_runs(gem, plugin_env):
    result = gem("example", "--json", env=plugin_env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["attention"] == ["example-sdpa"]


def test_gem_train_uses_the_third_party_backend(gem, plugin_env, tmp_path):
    result = gem("train", "--attention", "example-sdpa", "--out", str(tmp_path / "run"),
                 *QUICK_RUN, env=plugin_env)
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    chosen = summary["backends"]["attention"]
    assert chosen["name"] == "example-sdpa"
    assert chosen["package"] == "gem-example-plugin"
    assert chosen["reason"] == "named in the configuration"


def test_selecting_what_only_a_broken_plugin_could_provide_names_its_error(gem, plugin_env,
                                                                             tmp_path):
    result = gem("train", "--attention", "broken-fast", "--out", str(tmp_path / "run"),
                 *QUICK_RUN, env=plugin_env)
    assert result.returncode != 0
    assert "unknown attention implementation 'broken-fast'" in result.stderr
    installed = result.stderr.split("installed: ")[1].split(".")[0].split(", ")
    assert {"bucketed", "example-sdpa", "reference"} <= set(installed)
    assert "gem_broken (gem-broken-plugin): ImportError" in result.stderr
    assert "Traceback" not in result.stderr


def test_disabled_plugins_are_not_loaded(gem, plugin_env):
    env = {**plugin_env, "GEM_DISABLE_PLUGINS": "gem_example,gem_broken"}
    table = json.loads(gem("plugins", "--json", env=env).stdout)
    assert "example-sdpa" not in {row["name"] for row in table["kinds"]["attention"]}
    assert table["failed_plugins"] == []


def test_explicitly_named_backend_never_falls_back(gem, plugin_env, tmp_path):
    """example-sdpa declares softmax only; asking it for silu is refused at start-up, from its
    declared capabilities, naming the backends that compute silu."""
    result = gem("train", "--attention", "example-sdpa", "--set", "model.normalization=silu",
                 "--out", str(tmp_path / "run"), *QUICK_RUN, env=plugin_env)
    assert result.returncode != 0
    assert ("attention backend 'example-sdpa' does not support normalization silu (needed by "
            "model.normalization = silu); backends that do: ") in result.stderr
