"""Distillation in time order (``data.order = "time"``) with the Student Adapter fitted once or
refitted on each most recent window (``distill.adapter.refit``): the refit reads the window
before, the per-window figures reach summary.json, the adapter is the checkpoint's, a streaming
distillation stopped anywhere resumes bit for bit, precomputed signals keep the windows and
train the same student, and what cannot work is refused by name."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from gem_core.checkpoint.checkpointer import read_trainer_state
from gem_core.checkpoint.layout import complete_checkpoints
from gem_core.config import load_config
from gem_core.errors import GemConfigError
from gem_core.plugins import build_plugins
from gem_core.train.trainer import train
from gem_data.testing import write_generated_windows

WINDOWS = 3
# About 96 requests per window in batches of 32: 3 steps a window (4 where a cut moved past a
# tie); exact comparisons need deterministic algorithms.
SMALL = ("data.source=parquet", "data.order=time", "data.options={}", "train.batch_size=32",
         "train.steps=1000", "train.warmup_steps=1", "data.max_seq_len=16",
         "model.interaction_dims=[16]", "train.eval_batch_size=128", "train.deterministic=true",
         "train.checkpoint_every=0")
ADAPTER = ("distill.adapter.enabled=true", "distill.adapter.fit_batches=2")


@pytest.fixture(scope="module")
def plugins():
    return build_plugins()


@pytest.fixture(scope="module")
def windowed(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("windows") / "data"
    write_generated_windows(out, windows=WINDOWS)
    return out


def _config(data: Path, *extra: str):
    return load_config(preset="tiny", overrides=[*SMALL, f"data.path={data}", *extra])


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, windowed, plugins) -> Path:
    """A stale teacher: trained on the first window only (time order capped by train.steps)."""
    out = tmp_path_factory.mktemp("teacher") / "run"
    train(_config(windowed, "train.steps=3"), plugins, out, progress=False)
    return out


def _student(data: Path, teacher: Path, *extra: str):
    return _config(data, f"distill.teacher={teacher}", *extra)


def _losses(run: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["distill_loss"])
            for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


def _evals(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]


def _refits(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.getMessage().startswith("Student Adapter refitted on window")]


@pytest.fixture(scope="module")
def each_window(tmp_path_factory, windowed, teacher, plugins):
    out = tmp_path_factory.mktemp("each") / "run"
    config = _student(windowed, teacher, *ADAPTER, "distill.adapter.refit=each_window")
    return out, train(config, plugins, out, progress=False).summary


def test_each_window_refits_on_the_window_before_and_records_it(each_window, windowed):
    run, summary = each_window
    names = [w["window"] for w in summary["progressive"]["windows"]]
    assert len(names) == WINDOWS - 1  # every window after the first is evaluated
    distill = summary["distill"]
    assert distill["adapter"]["refit"] == "each_window"
    assert distill["adapter"]["fit"]["rows"] == 64  # the first fit: 2 batches of window 0
    assert distill["teacher_eval_ne"] == {}  # no eval split in time order: the windows'
    records = distill["windows"]
    assert [r["window"] for r in records] == names
    for index, record in enumerate(records, start=1):
        fit = record["adapter_fit"]
        assert fit["window_index"] == index - 1 and fit["rows"] == 64
        for task in ("click", "conversion"):
            assert fit["ne_after"][task] < fit["ne_before"][task]  # it fits its data
        assert set(record["teacher_ne"]) == {"raw", "adapted"}
    # Each refit starts from the identity, so its "before" is the raw teacher on that window.
    assert records[0]["adapter_fit"]["ne_before"] != records[1]["adapter_fit"]["ne_before"]
    # The checkpoint at the end holds the last window's adapter and the records.
    step, path = complete_checkpoints(run)[-1]
    state = read_trainer_state(path)["distill"]["windows"]
    assert state["refit"] == "each_window" and state["fitted_for"] == WINDOWS - 1
    assert state["records"] == records
    assert {name: tuple(value.shape) for name, value in state["adapter"].items()} == {
        "mix.weight": (2, 2), "mix.bias": (2,)}
    assert any(value.abs().sum() > 0 for value in state["adapter"].values())  # not the identity


def test_fitted_once_keeps_the_first_adapter_and_records_the_windows(tmp_path, windowed,
                                                                     teacher, plugins,
                                                                     each_window, caplog):
    with caplog.at_level(logging.INFO, logger="gem_core.distill"):
        once = train(_student(windowed, teacher, *ADAPTER), plugins, tmp_path / "once",
                     progress=False).summary
    assert not _refits(caplog)
    records = once["distill"]["windows"]
    assert len(records) == WINDOWS - 1 and not any("adapter_fit" in r for r in records)
    _, refitted = each_window
    # The same first fit and the same raw teacher, another adapter on the later windows.
    assert once["distill"]["adapter"]["fit"] == refitted["distill"]["adapter"]["fit"]
    for a, b in zip(records, refitted["distill"]["windows"]):
        assert a["teacher_ne"]["raw"] == b["teacher_ne"]["raw"]
        assert a["teacher_ne"]["adapted"] != b["teacher_ne"]["adapted"]
    assert _losses(tmp_path / "once")[:3] == _losses(each_window[0])[:3]  # window 0: the same


@pytest.mark.parametrize("until", [3, 4], ids=["at-a-window-end", "inside-a-window"])
def test_a_stopped_streaming_distillation_resumes_bit_for_bit(tmp_path, windowed, teacher,
                                                              plugins, each_window, caplog,
                                                              until):
    run, summary = each_window
    config = _student(windowed, teacher, *ADAPTER, "distill.adapter.refit=each_window")
    out = tmp_path / "run"
    train(config, plugins, out, progress=False, until_step=until)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="gem_core.distill"):
        resumed = train(config, plugins, out, progress=False).summary
    assert _losses(out) == _losses(run)
    assert _evals(out) == _evals(run)
    assert resumed["distill"]["windows"] == summary["distill"]["windows"]
    assert resumed["progressive"] == summary["progressive"]
    # Stopped inside window 1, the resumed run takes window 1's adapter from the checkpoint
    # and refits only for window 2; stopped at the end of window 0, it refits for both.
    expected = ["day-1", "day-2"] if until == 3 else ["day-2"]
    assert [m.split(" for window ")[1].split(":")[0].strip("'") for m in _refits(caplog)] == (
        expected)


def test_the_checkpoints_adapter_is_the_one_used_after_resume(tmp_path, windowed, teacher,
                                                              plugins):
    """A resumed run must use the checkpoint's adapter, not refit one: an adapter written into
    the checkpoint (here zeroed: the identity) changes the resumed steps' distillation loss."""
    from gem_core.checkpoint import io as checkpoint_io
    from gem_core.checkpoint.digests import write_digests
    from gem_core.checkpoint.layout import TRAINER_FILE, TRAINER_TENSORS_FILE

    config = _student(windowed, teacher, *ADAPTER, "distill.adapter.refit=each_window")
    out = tmp_path / "run"
    train(config, plugins, out, progress=False, until_step=4)
    before = _losses(out)
    _, path = complete_checkpoints(out)[-1]
    state = read_trainer_state(path)
    adapter = state["distill"]["windows"]["adapter"]
    state["distill"]["windows"]["adapter"] = {k: torch.zeros_like(v) for k, v in adapter.items()}
    checkpoint_io.write_trainer_state(state, path / TRAINER_FILE, path / TRAINER_TENSORS_FILE)
    write_digests(path)  # the altered checkpoint verifies, as if the trainer had written it
    train(config, plugins, out, progress=False, until_step=5)
    altered = _losses(out)
    assert altered[:4] == before[:4]
    again = tmp_path / "again"
    train(config, plugins, again, progress=False, until_step=5)
    assert altered[4][2] != _losses(again)[4][2]  # the identity adapter, not a refit one


def test_precomputed_signals_keep_the_windows_and_train_the_same_student(
        tmp_path, windowed, teacher, plugins, each_window):
    from gem_data.distill_precompute import precompute
    from gem_data.manifest import read_manifest

    data = tmp_path / "with-teacher"
    assert precompute(teacher, windowed, data, batch_size=64)["complete"]
    windows = read_manifest(data).windows
    assert [w.name for w in windows] == [w.name for w in read_manifest(windowed).windows]
    assert all(w.files and not w.state for w in windows)
    out = tmp_path / "run"
    config = _student(data, teacher, *ADAPTER, "distill.adapter.refit=each_window",
                      "distill.signals=precomputed")
    summary = train(config, plugins, out, progress=False).summary
    run, online = each_window
    for (step, loss, distill), (step2, loss2, distill2) in zip(_losses(out), _losses(run),
                                                                strict=True):
        assert step == step2
        assert loss == pytest.approx(loss2, rel=1e-5)
        assert distill == pytest.approx(distill2, rel=1e-5)
    for a, b in zip(summary["distill"]["windows"], online["distill"]["windows"], strict=True):
        for task in ("click", "conversion"):
            assert a["teacher_ne"]["adapted"][task] == pytest.approx(
                b["teacher_ne"]["adapted"][task], rel=1e-4)


def test_a_refit_that_cannot_happen_is_refused_by_name(tmp_path, windowed, teacher, plugins):
    with pytest.raises(GemConfigError, match="distill.adapter.refit = 'each_window' refits the "
                                             "Student Adapter, which is off"):
        train(_student(windowed, teacher, "distill.adapter.refit=each_window"), plugins,
              tmp_path / "a", progress=False)
    with pytest.raises(GemConfigError, match="it needs data.order = 'time' \\(this run's is "
                                             "'shuffled'\\)"):
        train(_student(windowed, teacher, *ADAPTER, "distill.adapter.refit=each_window",
                       "data.order=shuffled", "train.lr_schedule=cosine"), plugins,
              tmp_path / "b", progress=False)
    with pytest.raises(GemConfigError, match="distill.adapter.refit must be one of once, "
                                             "each_window; got 'always'"):
        _student(windowed, teacher, "distill.adapter.refit=always")
