"""Resuming when a trainable parameter had no gradient yet at the checkpoint: AdamW creates its
state lazily, so the checkpoint holds none for it. The resumed run loads, leaves that parameter
without state, and ends bit for bit where an uninterrupted run ends, that parameter's first
updates after the resume included."""

from __future__ import annotations

import json
import types
from pathlib import Path

import torch
import torch.nn.functional as F

from gem_core import hookimpl
from gem_core.checkpoint.checkpointer import read_checkpoint
from gem_core.config import load_config
from gem_core.embedding import ReferenceEmbeddingBackend, ReferenceEmbeddingCollection
from gem_core.plugins import build_plugins
from gem_core.registry import ImplementationSpec
from gem_core.train.trainer import train

SMALL = ["train.steps=4", "train.checkpoint_every=2", "train.batch_size=16",
         "data.eval_rows=32", "train.eval_batch_size=32", "train.warmup_steps=1",
         "train.eval_every=0", "data.max_seq_len=12", "model.interaction_dims=[16]",
         "train.deterministic=true", "backends.embedding=late-segment"]
LATE_TABLE = "user_segment"
LATE_STATE = f"embeddings.tables.{LATE_TABLE}.weight"
FIRST_GRADIENT_STEP = 3  # after the checkpoint of step 2


class _LateTable(ReferenceEmbeddingCollection):
    """Reference tables whose ``user_segment`` table gets its first gradient at training step
    ``FIRST_GRADIENT_STEP`` (its lookups before that use a detached copy): a table no batch
    has looked up yet. ``steps`` counts training forwards across the runs of one test, so a
    resumed run continues the count where the stopped one left it."""

    def __init__(self, tables, steps: dict[str, int]) -> None:
        super().__init__(tables)
        self.steps = steps

    def forward(self, features):
        out = super().forward(features)
        if self.training and torch.is_grad_enabled():
            self.steps["forwards"] += 1
            if self.steps["forwards"] < FIRST_GRADIENT_STEP:
                ids = features[LATE_TABLE]
                out[LATE_TABLE] = F.embedding_bag(
                    ids.values, self.tables[LATE_TABLE].weight.detach(), ids.offsets[:-1],
                    mode=self.table_configs[LATE_TABLE].pooling)
        return out


def _plugins(steps: dict[str, int]):
    class Backend(ReferenceEmbeddingBackend):
        def build(self, tables):
            return _LateTable(tables, steps)

    def register(register):
        register(ImplementationSpec(name="late-segment", load=Backend))

    plugin = types.SimpleNamespace(gem_register_embedding_backends=hookimpl(register))
    return build_plugins(load_entry_points=False, extra_plugins=[("late-segment", plugin)])


def _flat(value, prefix=""):
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _flat(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _flat(item, f"{prefix}[{i}]")
    else:
        yield prefix, value


def _engine(run: Path, step: int) -> dict:
    return dict(_flat(read_checkpoint(run / "checkpoints" / f"step-{step:08d}")["engine"]))


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_resume_leaves_a_parameter_without_optimizer_state_as_it_was(tmp_path):
    config = load_config(overrides=SMALL)
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    train(config, _plugins({"forwards": 0}), whole, progress=False)
    stopped_steps = {"forwards": 0}
    train(config, _plugins(stopped_steps), stopped, progress=False, until_step=2)

    at_stop = _engine(stopped, 2)
    assert not any(LATE_STATE in key for key in at_stop if key.startswith("optimizer.state."))
    assert any(key.startswith(f"optimizer.state.{LATE_STATE}.") for key in _engine(whole, 4))

    result = train(config, _plugins(stopped_steps), stopped, progress=False)
    assert result.summary["run"]["resumed_from"] == 2
    assert _losses(stopped) == _losses(whole)
    expected, resumed = _engine(whole, 4), _engine(stopped, 4)
    assert sorted(resumed) == sorted(expected)
    # The late table's optimizer step counts its own updates (2), not the run's steps.
    assert float(resumed[f"optimizer.state.{LATE_STATE}.step"]) == 4 - FIRST_GRADIENT_STEP + 1
    differing = [key for key, value in expected.items()
                 if not (torch.equal(value, resumed[key]) if torch.is_tensor(value)
                         else value == resumed[key])]
    assert differing == []
