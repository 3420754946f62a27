"""`gem train` end to end on CPU: the run-directory contract, resume, several ranks."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from gem_core.testing.runs import SMALL_RUN as SMALL

METRIC_KEYS = {"step", "loss", "samples", "tokens", "step_time_s"}


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def whole_run(small_run) -> Path:
    """SMALL trained in one go, shared with the parallel tests (read only: tests that run it
    again use a copy)."""
    return small_run


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, gem) -> Path:
    """SMALL stopped after step 2 (its checkpoint); each test resumes its own copy."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    result = gem("train", "--out", str(out), "--until-step", "2", *SMALL)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["run"]["finished"] is False
    return out


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


@pytest.mark.slow
def test_gem_train_with_no_options_meets_the_contract_and_beats_the_base_rate(gem, tmp_path):
    result = gem("train", cwd=tmp_path, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.startswith("tiny-")
    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, 301))
    assert all(METRIC_KEYS <= m.keys() for m in metrics)
    assert metrics[-1]["samples"] == 300 * 256
    # Evaluation steps (every 100) carry the held-out figures, equal to summary.json's at the end.
    assert [m["step"] for m in metrics if "eval_ne_click" in m] == [100, 200, 300]
    summary = json.loads((run_dir / "summary.json").read_text())
    # The last evaluation is eval_last; the headline is the checkpoint readers use (the best).
    assert metrics[-1]["eval_ne_conversion"] == summary["eval_last"]["conversion"]["ne"]
    assert summary["checkpoint_used"]["step"] in (100, 200, 300)
    for task in ("click", "conversion"):
        report = summary["eval"][task]
        assert math.isfinite(report["ne"]) and report["ne"] < 1.0, (task, report)
        assert 0.5 < report["auc"] <= 1.0
        assert report["calibration"] > 0
    assert summary["run"]["finished"] and summary["run"]["steps"] == 300
    assert summary["throughput"]["samples_per_s"] > 0
    assert summary["flops"]["per_step"] > 0
    assert 0 < summary["mfu"]["local"] < 1
    assert summary["mfu"]["scaling_ratio"] == 1.0
    assert 0 < summary["padding_saved"]["attention"] < 1
    assert summary["config"]["name"] == "tiny"
    assert summary["backends"]["attention"]["reason"].startswith("auto: ")
    assert any(p.name.startswith("step-") for p in (run_dir / "checkpoints").iterdir())
    assert any(p.name.startswith("events.out.tfevents")
               for p in (run_dir / "tensorboard").iterdir())


def test_stopping_and_resuming_gives_the_same_losses_bit_for_bit(gem, tmp_path, whole_run,
                                                                 stopped_run):
    whole, parts = _copy(whole_run, tmp_path / "whole"), _copy(stopped_run, tmp_path / "parts")
    second = gem("train", "--out", str(parts), *SMALL)
    assert second.returncode == 0, second.stderr[-3000:]
    assert json.loads((parts / "summary.json").read_text())["run"]["resumed_from"] == 2
    expected = [(m["step"], m["loss"], m["grad_norm"]) for m in _metrics(whole)]
    got = [(m["step"], m["loss"], m["grad_norm"]) for m in _metrics(parts)]
    assert got == expected
    # TensorBoard holds the same curve, once, across the interruption.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(parts / "tensorboard"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert [step for step, _ in logged] == list(range(1, 7))
    assert [v for _, v in logged] == pytest.approx([m["loss"] for m in _metrics(whole)])
    # Each evaluation figure once, under eval/ (metrics.jsonl's eval_* columns are not repeated).
    tags = events.Tags()["scalars"]
    assert "eval/click/ne" in tags and _metrics(parts)[-1]["eval_ne_click"] > 0
    assert not [tag for tag in tags if tag.startswith("train/eval_")], tags
    # Running a finished run again trains nothing and still reports.
    again = gem("train", "--out", str(whole), *SMALL)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["run"]["resumed_from"] == 6 and summary["run"]["finished"]
    assert len(_metrics(whole)) == 6


def test_resuming_with_a_different_model_is_refused(gem, tmp_path, stopped_run):
    tmp_path = _copy(stopped_run, tmp_path / "run")
    result = gem("train", "--out", str(tmp_path), *SMALL, "--set", "model.num_layers=1")
    assert result.returncode != 0
    assert "different [model] (num_layers)" in result.stderr and "--fresh" in result.stderr
    assert gem("train", "--out", str(tmp_path), *SMALL, "--set", "model.num_layers=1",
               "--fresh").returncode == 0


def test_a_torn_checkpoint_is_ignored(gem, tmp_path, stopped_run):
    tmp_path = _copy(stopped_run, tmp_path / "run")
    torn = tmp_path / "checkpoints" / "step-00000004"
    torn.mkdir()
    (torn / "state.pt").write_bytes(b"half a checkpoint")  # no COMPLETE marker
    result = gem("train", "--out", str(tmp_path), *SMALL)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "summary.json").read_text())["run"]["resumed_from"] == 2


def test_bad_set_value_is_a_clear_error(gem, tmp_path):
    result = gem("train", "--out", str(tmp_path), "--set", "train.steps=abc")
    assert result.returncode != 0
    assert "train.steps must be an integer; got 'abc'" in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_backend_lists_installed(gem, tmp_path):
    result = gem("train", "--out", str(tmp_path), "--precision", "fp4-magic")
    assert result.returncode != 0
    assert "unknown precision implementation 'fp4-magic'; installed:" in result.stderr
    assert "fp32" in result.stderr


@pytest.mark.distributed
def test_two_ranks_with_ddp_match_one_process(gem, tmp_path, whole_run):
    """DDP over gloo with the LPT balancer: the same global batches, so the same losses as one
    process up to float summation order (tolerance 1e-4 relative over 6 steps)."""
    one, two = whole_run, tmp_path / "two"
    result = gem("train", "--out", str(two), "--nproc-per-node", "2", *SMALL)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((two / "summary.json").read_text())
    assert summary["run"]["world_size"] == 2
    assert summary["backends"]["dense_sharding"]["name"] == "ddp"
    assert summary["backends"]["balancer"]["name"] == "lpt"
    for a, b in zip(_metrics(one), _metrics(two), strict=True):
        assert a["samples"] == b["samples"] and a["tokens"] == b["tokens"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)


LEARNED_PATH_LOSS = ["--set", "model.attribute_attention=true",
                     "--set", "model.attribute_attention_loss=0.5"]


@pytest.mark.distributed
def test_the_models_own_loss_on_two_ranks_matches_one_process(gem, tmp_path):
    """Attribute attention's own loss (``model.attribute_attention_loss``) is normalised by the
    global batch's impressions like the task losses: the ranks' shares of a batch hold
    different numbers of impressions, and a per-rank mean would train another loss (the losses
    of steps 2 on would differ by about 1e-3 relative)."""
    runs = {}
    for ranks in (1, 2):
        runs[ranks] = tmp_path / f"ranks-{ranks}"
        result = gem("train", "--out", str(runs[ranks]), "--nproc-per-node", str(ranks),
                     *SMALL, *LEARNED_PATH_LOSS)
        assert result.returncode == 0, result.stderr[-3000:]
    for a, b in zip(_metrics(runs[1]), _metrics(runs[2]), strict=True):
        assert a["samples"] == b["samples"]
        assert a["learned_path_loss"] > 0.1  # weighted BCE of two tasks, near 2 x 0.5 x log 2
        assert b["learned_path_loss"] == pytest.approx(a["learned_path_loss"], rel=1e-4)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)


def test_checkpoints_of_the_single_candidate_trainer_are_refused(gem, tmp_path, stopped_run):
    """A checkpoint written before request-level samples (no model format in its side file) is
    refused with a message that says why and what to do, before anything is loaded."""
    from gem_core.checkpoint.digests import write_digests
    from gem_core.checkpoint.io import read_trainer_state, write_trainer_state

    tmp_path = _copy(stopped_run, tmp_path / "run")
    checkpoint = next((tmp_path / "checkpoints").glob("step-*"))
    side = (checkpoint / "trainer.json", checkpoint / "trainer-tensors.pt")
    state = read_trainer_state(*side)
    del state["model_format"], state["schema"]
    write_trainer_state(state, *side)
    write_digests(checkpoint)  # as that older trainer's checkpoint would verify
    result = gem("train", "--out", str(tmp_path), *SMALL)
    assert result.returncode != 0
    assert "older GEM trainer (model format 1" in result.stderr and "--fresh" in result.stderr
