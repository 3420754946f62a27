"""Training on a stream of logs (``data.order = "time"``): a data set's time windows once, oldest
first, each evaluated before the model trains on it (progressive evaluation), continued when the
data set gains windows. One run over all the windows equals a run that stopped after each
window and continued when the next was appended, bit for bit (losses and evaluations), and
equals a run stopped in the middle of a window and resumed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from gem_core.testing.runs import jsonl_records, step_losses
from gem_data.testing import write_generated_windows

WINDOWS = 3
# 96 requests per window in batches of 32: 3 steps a window (4 where a cut moved past a tie).
TRAIN = ("data.source=parquet", "data.order=time", "data.options={}", "train.batch_size=32",
         "train.steps=1000", "train.warmup_steps=1", "data.max_seq_len=16",
         "model.interaction_dims=[16]", "train.eval_batch_size=128",
         "train.deterministic=true")  # exact comparisons: deterministic algorithms on CPU


def _sets(overrides) -> list[str]:
    return [arg for item in overrides for arg in ("--set", item)]


def _train(gem, run: Path, data: Path, *extra: str):
    done = gem("train", "--preset", "tiny", "--out", str(run), "--no-progress",
               *_sets(TRAIN + (f"data.path={data}",)), *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def windowed(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("windows") / "data"
    write_generated_windows(out, windows=WINDOWS)
    return out


@pytest.fixture(scope="module")
def one_go(tmp_path_factory, gem, windowed):
    """(run directory, stdout) of one run over every window."""
    run = tmp_path_factory.mktemp("one-go") / "run"
    return run, _train(gem, run, windowed).stdout


def test_one_run_equals_a_run_continued_as_each_window_is_appended(tmp_path, gem, one_go):
    run, _ = one_go
    growing, continued = tmp_path / "data", tmp_path / "run"
    for count in range(1, WINDOWS + 1):
        assert len(write_generated_windows(growing, windows=WINDOWS, upto=count)) == count
        done = _train(gem, continued, growing)  # the same --out: continues, no flag needed
        assert f"windows trained: {count} of {count}" in done.stdout
    assert step_losses(continued) == step_losses(run)
    assert jsonl_records(continued / "eval.jsonl") == jsonl_records(run / "eval.jsonl")
    one, grown = (json.loads((r / "summary.json").read_text()) for r in (run, continued))
    assert grown["progressive"] == one["progressive"]
    assert grown["eval"] == one["eval"]


def test_a_run_stopped_inside_a_window_resumes_exactly(tmp_path, gem, windowed, one_go):
    run, _ = one_go
    stopped = tmp_path / "run"
    _train(gem, stopped, windowed, "--until-step", "4", "--set", "train.checkpoint_every=2")
    _train(gem, stopped, windowed)
    assert step_losses(stopped) == step_losses(run)
    assert jsonl_records(stopped / "eval.jsonl") == jsonl_records(run / "eval.jsonl")


def test_progressive_evaluation_in_eval_jsonl_summary_report_and_final_line(gem, one_go):
    run, stdout = one_go
    evals = jsonl_records(run / "eval.jsonl")
    # every window but the first, scored before training on it: at the step that ended the one
    # before, by a model that has seen none of it
    assert [e["window"] for e in evals] == [f"day-{i}" for i in range(1, WINDOWS)]
    assert all(e["window_rows"] > 0 and e["click"]["samples"] > 0 for e in evals)
    summary = json.loads((run / "summary.json").read_text())
    progressive = summary["progressive"]
    assert progressive["windows_trained"] == progressive["windows_total"] == WINDOWS
    assert [w["window"] for w in progressive["windows"]] == ["day-1", "day-2"]
    steps = [w["step"] for w in progressive["windows"]]
    assert steps == sorted(steps) and steps[0] > 0
    mean_ne = sum(e["click"]["ne"] for e in evals) / len(evals)
    assert summary["eval"]["click"]["ne"] == pytest.approx(mean_ne, rel=1e-12)
    assert summary["eval"]["click"]["windows"] == len(evals)
    assert summary["run"]["stopped"]["reason"] == "windows"
    assert summary["checkpoint_used"]["step"] == summary["run"]["steps"]  # the newest model
    assert "progressive (mean over 2 windows" in stdout and "windows trained: 3 of 3" in stdout
    # a checkpoint ends every window (train.checkpoint_every is 100), so the run continues
    # from any window's end; train.keep_checkpoints = 2 keeps the last two
    checkpoints = sorted(int(p.name.split("-")[1]) for p in (run / "checkpoints").iterdir())
    assert checkpoints == [*steps, summary["run"]["steps"]][-2:]
    done = gem("report", str(run))
    assert done.returncode == 0, done.stderr[-2000:]
    assert (run / "report" / "progressive.png").is_file()
    assert "progressive, mean of 2 windows" in (run / "report" / "index.html").read_text()


def test_a_finished_stream_with_no_new_window_trains_nothing_more(tmp_path, gem, one_go):
    run, _ = one_go
    again = tmp_path / "run"
    shutil.copytree(run, again)
    before = step_losses(again)
    done = gem("train", "--preset", "tiny", "--out", str(again), "--no-progress",
               *_sets(TRAIN + (f"data.path={_data_path(run)}",)))
    assert done.returncode == 0, done.stderr[-3000:]
    assert step_losses(again) == before
    assert "all 3 windows are trained on already" in done.stderr


def _data_path(run: Path) -> str:
    return json.loads((run / "summary.json").read_text())["data"]["path"]


def _refusal(tmp_path, data: Path, *overrides: str) -> str:
    from gem_core.cli.main import cli

    result = CliRunner().invoke(cli, ["train", "--preset", "tiny", "--out",
                                      str(tmp_path / "run"), "--no-progress",
                                      *_sets(TRAIN + (f"data.path={data}",) + overrides)])
    assert result.exit_code != 0, result.output
    return result.output


@pytest.mark.parametrize("overrides, message", [
    (("train.lr_schedule=cosine",), "train.lr_schedule = 'cosine' decays towards train.steps"),
    (("train.early_stopping_patience=2",), "train.early_stopping_patience"),
    (("train.epochs=2",), "train.epochs = 2: time order is one pass over the windows"),
    (("train.validation_share=0.5",), "train.validation_share = 0.5: each evaluation is of "
                                      "another window"),
    (('data.options={sharding = "row_groups"}',), "sharding = 'global'"),
    (("data.source=synthetic",), "data source 'synthetic' has none"),
])
def test_what_time_order_cannot_do_is_refused_by_name(tmp_path, windowed, overrides, message):
    assert message in _refusal(tmp_path, windowed, *overrides)


def test_time_order_on_a_data_set_without_windows_names_the_commands(tmp_path, gem):
    flat = tmp_path / "flat"
    done = gem("data", "synth", "--rows", "64", "--eval-rows", "32", "--out", str(flat))
    assert done.returncode == 0, done.stderr[-2000:]
    output = _refusal(tmp_path, flat)
    assert "has none" in output and "gem data import --window" in output


def test_the_time_stream_never_mixes_windows_and_resumes_anywhere(windowed):
    """Batches end at window ends; a position saved after any batch continues exactly; the
    position after the last window stays valid when windows are added."""
    from gem_core.config import DataConfig
    from gem_core.data.api import contiguous_balancer
    from gem_core.plugins import build_plugins

    config = DataConfig(source="parquet", path=str(windowed), order="time", max_seq_len=16)
    source = build_plugins().data_source(config, seed=3)

    def stream():
        return source.train_stream(batch_size=32, rank=0, world_size=1,
                                   balancer=contiguous_balancer, cost_fn=lambda b: [1.0] * 32)

    whole = stream()
    batches, positions = [], []
    for batch in whole:
        batches.append(batch.request_timestamps.tolist())
        positions.append(whole.state_dict())
    windows = source.windows()
    bounds = [(w.first_time, w.last_time) for w in windows]
    for times in batches:  # each batch inside one window's time range
        assert sum(lo <= min(times) and max(times) <= hi for lo, hi in bounds) == 1
    assert sum(len(t) for t in batches) == sum(w.rows for w in windows)
    assert source.window_at(positions[-1]) == (len(windows), False)
    for cut in range(len(batches) - 1):
        resumed = stream()
        resumed.load_state_dict(positions[cut])
        rest = [b.request_timestamps.tolist() for b in resumed]
        assert rest == batches[cut + 1:], f"resumed after batch {cut}"


def test_a_drifting_synthetic_log_trains_window_by_window(tmp_path, gem):
    data = tmp_path / "drifting"
    done = gem("data", "synth", "--windows", "3", "--window-rows", "96", "--out", str(data),
               "--set", "num_items=300")
    assert done.returncode == 0, done.stderr[-2000:]
    run = tmp_path / "run"
    _train(gem, run, data)
    manifest = json.loads((data / "manifest.json").read_text())
    names = [w["name"] for w in manifest["windows"]]
    evaluated = [e["window"] for e in jsonl_records(run / "eval.jsonl")]
    assert evaluated == names[1:]
    # the generating process's own NE on each window is there to compare with
    assert all("achievable_ne" in w["info"] for w in manifest["windows"])


@pytest.mark.distributed
def test_two_ranks_stream_the_same_windows_as_one_process(tmp_path, gem, windowed, one_go):
    """Every rank reads the same global batches, so windows end at the same step on every rank
    and the evaluations are those of one process (up to the order of float sums)."""
    run, _ = one_go
    two = tmp_path / "two"
    _train(gem, two, windowed, "--nproc-per-node", "2", "--sharding", "ddp")
    mine, theirs = jsonl_records(two / "eval.jsonl"), jsonl_records(run / "eval.jsonl")
    assert [(e["window"], e["step"]) for e in mine] == [(e["window"], e["step"]) for e in theirs]
    for a, b in zip(mine, theirs):
        assert a["click"]["ne"] == pytest.approx(b["click"]["ne"], rel=1e-3)


def test_a_time_order_run_exports_with_its_newest_window_as_example(tmp_path, gem, one_go):
    run, _ = one_go
    done = gem("export-model", str(run), "--out", str(tmp_path / "export"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "export" / "manifest.json").is_file()
