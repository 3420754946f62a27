"""``gem_core.trained_run.load_run``: the one way a finished run is reopened (export, scoring,
distillation). The rebuilt model predicts what the trainer evaluated at that checkpoint."""

from __future__ import annotations

import shutil

import pytest

from gem_core.config import load_config
from gem_core.errors import GemConfigError
from gem_core.testing.runs import assert_reproduces_last_evaluation
from gem_core.trained_run import load_run


@pytest.fixture(scope="module")
def run(small_run):
    """The session's SMALL_RUN run (checkpoints at steps 3 and 6; read only)."""
    return small_run


def test_loaded_model_reproduces_the_trainers_evaluation(run):
    loaded = load_run(run)
    assert loaded.step == 6 and not loaded.model.training
    assert_reproduces_last_evaluation(loaded, run)
    assert load_run(run, step=3).step == 3


def test_bad_run_directories_are_named(run, tmp_path):
    with pytest.raises(GemConfigError, match="not a run directory"):
        load_run(tmp_path)
    with pytest.raises(GemConfigError, match="no complete checkpoint of step 7"):
        load_run(run, step=7)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(run / "config.toml", bare / "config.toml")
    with pytest.raises(GemConfigError, match="has no complete checkpoint"):
        load_run(bare)
    with pytest.raises(GemConfigError, match="unknown backend kinds"):
        load_run(run, backends={"attenton": "reference"})


def test_data_with_another_schema_is_refused(run):
    config = load_config(path=run / "config.toml", overrides=["data.options.num_items=999"])
    with pytest.raises(GemConfigError, match="another feature schema"):
        load_run(run, data=config.data)
