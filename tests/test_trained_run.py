"""``gem_core.trained_run.load_run``: the one way a finished run is reopened (export, scoring,
distillation). The rebuilt model predicts what the trainer evaluated at that checkpoint."""

from __future__ import annotations

import shutil

import pytest

from gem_core.config import load_config
from gem_core.errors import GemConfigError
from gem_core.testing.runs import assert_reproduces_last_evaluation
from gem_core.trained_run import load_run

SMALL = ("train.steps=3", "train.batch_size=32", "train.eval_every=3", "train.checkpoint_every=3",
         "data.eval_rows=128", "data.max_seq_len=24")


@pytest.fixture(scope="module")
def run(tmp_path_factory, gem):
    out = tmp_path_factory.mktemp("trained") / "run"
    args = [x for pair in SMALL for x in ("--set", pair)]
    done = gem("train", "--out", str(out), "--no-progress", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_loaded_model_reproduces_the_trainers_evaluation(run):
    loaded = load_run(run)
    assert loaded.step == 3 and not loaded.model.training
    assert_reproduces_last_evaluation(loaded, run)


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
