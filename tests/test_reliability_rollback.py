"""The guard's rollback with DCP checkpoints written in the background: after K consecutive
non-finite steps the run returns to the latest checkpoint (first waiting for a save still being
written in the background) and finishes with finite weights, the rollback counted."""

from __future__ import annotations

import json
import types

import torch

from gem_core import hookimpl
from gem_core.checkpoint.checkpointer import read_checkpoint
from gem_core.checkpoint.layout import latest_checkpoint
from gem_core.config import load_config
from gem_core.embedding import ReferenceEmbeddingBackend
from gem_core.plugins import build_plugins
from gem_core.registry import ImplementationSpec
from gem_core.train.trainer import train

SMALL = ["train.batch_size=32", "data.eval_rows=128", "train.eval_batch_size=128",
         "train.warmup_steps=1", "train.eval_every=0", "data.max_seq_len=24",
         "model.interaction_dims=[16]"]


class _NanAtSteps(ReferenceEmbeddingBackend):
    """Reference tables whose gradient is NaN at the chosen backward calls (1-based)."""

    def __init__(self, bad_calls: set[int]) -> None:
        self.bad_calls = bad_calls

    def build(self, tables):
        module = super().build(tables)
        calls = {"n": 0}

        def poison(grad: torch.Tensor) -> torch.Tensor:
            calls["n"] += 1
            return grad * float("nan") if calls["n"] in self.bad_calls else grad

        module.tables["item"].weight.register_hook(poison)
        return module


def _plugins(bad_calls: set[int]):
    def register(register):
        register(ImplementationSpec(name="nan-at", load=lambda: _NanAtSteps(bad_calls)))

    plugin = types.SimpleNamespace(gem_register_embedding_backends=hookimpl(register))
    return build_plugins(load_entry_points=False, extra_plugins=[("nan-at", plugin)])


def test_rollback_to_a_background_checkpoint(tmp_path):
    config = load_config(overrides=[*SMALL, "train.steps=8", "train.checkpoint_every=2",
                                    "train.max_bad_steps=2", "train.async_checkpoint=true",
                                    "backends.embedding=nan-at"])
    # Steps 5 and 6 go bad right after the step-4 checkpoint was started in the background.
    result = train(config, _plugins({5, 6}), tmp_path, progress=False)
    assert result.summary["guard"]["rollbacks"] == 1
    assert result.summary["guard"]["reasons"] == {"non-finite gradient norm": 2}
    assert result.summary["checkpoints"]["async"] is True
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 9))
    assert not any("skipped" in m for m in metrics)
    step, path = latest_checkpoint(tmp_path)
    assert step == 8
    weights = read_checkpoint(path)["engine"]["model"]
    assert all(torch.isfinite(w).all() for w in weights.values())
