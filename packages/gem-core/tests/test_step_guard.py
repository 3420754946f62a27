"""NaN/Inf and loss-spike guards: skipped steps, counted; rollback after K bad steps."""

from __future__ import annotations

import json
import types

import pytest
import torch

from gem_core import hookimpl
from gem_core.config import TrainConfig, load_config
from gem_core.embedding import ReferenceEmbeddingBackend
from gem_core.plugins import build_plugins
from gem_core.registry import ImplementationSpec
from gem_core.train.guard import MIN_HISTORY, StepGuard
from gem_core.train.trainer import train

SMALL = ["train.batch_size=32", "data.eval_rows=128", "train.eval_batch_size=128",
         "train.warmup_steps=1", "train.eval_every=0", "data.max_seq_len=24",
         "model.interaction_dims=[16]"]


def test_guard_verdicts():
    guard = StepGuard(TrainConfig(spike_factor=3.0, spike_window=20))
    assert guard.verdict(float("nan"), 1.0) == "non-finite loss"
    assert guard.verdict(1.0, float("inf")) == "non-finite gradient norm"
    for _ in range(MIN_HISTORY):
        guard.record(1.0, guard.verdict(1.0, 1.0))
    assert guard.verdict(2.9, 1.0) is None
    assert guard.verdict(3.1, 1.0).startswith("loss spike")
    guard.record(3.1, "loss spike (...)")
    assert guard.report() == {"skipped_steps": 1, "reasons": {"loss spike": 1}, "rollbacks": 0}


class _PoisonedEmbeddings(ReferenceEmbeddingBackend):
    """Reference tables whose gradient turns NaN at the chosen optimizer steps (1-based),
    standing in for a numerical blow-up on one rank."""

    def __init__(self, bad_steps: set[int]) -> None:
        self.bad_steps = bad_steps

    def build(self, tables):
        module = super().build(tables)
        calls = {"n": 0}

        def poison(grad: torch.Tensor) -> torch.Tensor:
            calls["n"] += 1
            return grad * float("nan") if calls["n"] in self.bad_steps else grad

        module.tables["item"].weight.register_hook(poison)
        return module


def _plugins(bad_steps: set[int]):
    def register(register):
        register(ImplementationSpec(name="poisoned", load=lambda: _PoisonedEmbeddings(bad_steps)))

    plugin = types.SimpleNamespace(gem_register_embedding_backends=hookimpl(register))
    return build_plugins(load_entry_points=False, extra_plugins=[("poison", plugin)])


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_nan_gradients_skip_the_step_and_leave_the_weights_untouched(tmp_path):
    config = load_config(overrides=[*SMALL, "train.steps=5", "backends.embedding=poisoned"])
    result = train(config, _plugins({3}), tmp_path, progress=False)
    metrics = _metrics(tmp_path)
    assert [m.get("skipped") for m in metrics] == [None, None, "non-finite gradient norm",
                                                    None, None]
    assert result.summary["guard"] == {"skipped_steps": 1,
                                       "reasons": {"non-finite gradient norm": 1},
                                       "rollbacks": 0}
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics)
    assert all(r["ne"] == r["ne"] for r in result.summary["eval"].values())  # not NaN


def test_consecutive_bad_steps_roll_back_to_the_checkpoint(tmp_path):
    config = load_config(overrides=[*SMALL, "train.steps=8", "train.checkpoint_every=2",
                                    "train.max_bad_steps=2", "backends.embedding=poisoned"])
    result = train(config, _plugins({5, 6}), tmp_path, progress=False)
    guard = result.summary["guard"]
    assert guard["rollbacks"] == 1
    assert guard["reasons"] == {"non-finite gradient norm": 2}
    metrics = _metrics(tmp_path)
    assert [m["step"] for m in metrics] == list(range(1, 9))
    assert not any("skipped" in m for m in metrics)  # the bad steps were rolled back over
    assert result.summary["run"]["steps"] == 8


def test_bad_steps_without_a_checkpoint_stop_with_a_clear_error(tmp_path):
    config = load_config(overrides=[*SMALL, "train.steps=6", "train.checkpoint_every=0",
                                    "train.max_bad_steps=2", "backends.embedding=poisoned"])
    with pytest.raises(RuntimeError, match="2 consecutive steps were skipped .* no checkpoint"):
        train(config, _plugins({2, 3}), tmp_path, progress=False)
