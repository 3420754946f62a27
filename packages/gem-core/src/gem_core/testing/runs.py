"""Checks on a finished run directory, shared by the tests of everything that reopens one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gem_core.metrics import task_report
from gem_core.trained_run import LoadedRun


def assert_reproduces_last_evaluation(run: LoadedRun, run_dir: Path) -> None:
    """The reopened model's NE on the held-out split, per task, equals the one the trainer
    logged last in ``eval.jsonl`` (the checkpoint's step): every weight was loaded."""
    predicted: dict[str, list[torch.Tensor]] = {task: [] for task in run.schema.tasks}
    labels: dict[str, list[torch.Tensor]] = {task: [] for task in run.schema.tasks}
    with torch.no_grad():
        for batch in run.source.eval_batches(batch_size=run.config.train.eval_batch_size):
            out = run.model(batch)
            for task in run.schema.tasks:
                predicted[task].append(out[task])
                labels[task].append(batch.labels[task])
    last = json.loads((Path(run_dir) / "eval.jsonl").read_text().splitlines()[-1])
    assert last["step"] == run.step
    for task in run.schema.tasks:
        ne = task_report(torch.cat(predicted[task]), torch.cat(labels[task]))["ne"]
        assert ne == pytest.approx(last[task]["ne"], rel=1e-6, abs=1e-7), task


#: ``gem train`` arguments of a short one-process ``tiny`` run (6 steps of 64, evaluated at the
#: end, checkpoints at steps 3 and 6): the reference several end-to-end tests compare against
#: (a resumed run, DDP, FSDP2, HSDP, DeepSpeed), trained once per test session. Its learning
#: rate is pinned at 0.001, where the comparisons' tolerances were measured: Adam turns the
#: float32 sum-order noise of a near-zero gradient into a step of up to ``lr``, and at the
#: preset's 0.002 one embedding row of ZeRO-3 landed 1.3e-5 from one process's (limit 1e-5).
#: The feature tables are pinned to AdamW (the ``[model.embedding_optimizer]`` section at its
#: defaults): DeepSpeed cannot step them row-wise, so only AdamW is a trajectory every strategy
#: can follow; row-wise tables on sharded ranks are compared in a test of their own.
SMALL_RUN = ("--set", "model.embedding_optimizer.dense_tables=adamw",
             "--set", "model.embedding_optimizer.lr=0.02",
             "--set", "train.steps=6", "--set", "train.batch_size=64", "--set", "train.lr=0.001",
             "--set", "data.eval_rows=256", "--set", "train.eval_batch_size=256",
             "--set", "train.warmup_steps=2", "--set", "train.eval_every=0",
             "--set", "train.checkpoint_every=3", "--set", "data.max_seq_len=48", "--no-progress")


def jsonl_records(path: Path) -> list[dict]:
    """Every record of a run's ``.jsonl`` file (``metrics.jsonl``, ``eval.jsonl``), in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def step_losses(run_dir: Path) -> list[tuple[int, float]]:
    """``(step, loss)`` of every step record in ``metrics.jsonl``."""
    return [(r["step"], r["loss"]) for r in jsonl_records(Path(run_dir) / "metrics.jsonl")]
