"""Dense sharding strategies of gem-parallel end to end: ``gem train --nproc-per-node N`` with
FSDP2, HSDP and DeepSpeed ZeRO 1-3 over gloo against one process on the same global batches."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from gem_core.testing.runs import SMALL_RUN

SMALL = list(SMALL_RUN)

# Same global batches, same math: only the order of float32 sums differs (reduce-scatter vs one
# backward), so losses agree to 1e-5 relative and final weights to 1e-5 absolute after 6 AdamW
# steps (measured: losses to ~1e-7, weights to ~6e-7).
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-5

# DeepSpeed JIT-builds a small communication op once per cache (about 22 s); share the Makefile's.
ENV = {"TORCH_EXTENSIONS_DIR": os.environ.get(
    "TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".cache/torch_extensions"))}


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"]
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from gem_core.checkpoint.checkpointer import read_checkpoint

    return read_checkpoint(run_dir / "checkpoints" / "step-00000006")["engine"]["model"]


@pytest.fixture(scope="module")
def single_process(small_run) -> Path:
    """One process on the same global batches (the session's shared SMALL_RUN run)."""
    return small_run


HSDP_2X2 = ["--set", "parallel.dense.dp_replicate=2", "--set", "parallel.dense.dp_shard=2"]


@pytest.mark.distributed
@pytest.mark.parametrize("sharding, ranks, extra, resume", [
    # resume=True stops at step 3 and resumes from the checkpoint: the full state dict written
    # by the sharded engine and loaded back into it must continue the same trajectory.
    ("fsdp2", 2, [], True),
    ("hsdp", 4, HSDP_2X2, True),
    ("deepspeed-zero1", 2, [], False),
    # ZeRO-2 differs from ZeRO-1 only in partitioning gradients too; slow-marked to keep the
    # default distributed set short on 2 cores.
    pytest.param("deepspeed-zero2", 2, [], False, marks=pytest.mark.slow),
    ("deepspeed-zero3", 2, [], True),
    # One process: ZeRO over a one-rank group (started by the strategy, no launcher), with a
    # stop and resume through its full-state checkpoint.
    ("deepspeed-zero3", 1, [], True),
])
def test_sharded_run_matches_one_process(gem, tmp_path, single_process, sharding, ranks, extra,
                                         resume):
    out = tmp_path / sharding
    command = ["train", "--out", str(out), "--nproc-per-node", str(ranks),
               "--sharding", sharding, *extra, *SMALL]
    if resume:
        result = gem(*command, "--until-step", "3", env=ENV)
        assert result.returncode == 0, result.stderr[-3000:]
    result = gem(*command, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    if resume:
        assert "resumed from" in result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["world_size"] == ranks
    assert summary["backends"]["dense_sharding"]["name"] == sharding
    assert _losses(out) == pytest.approx(_losses(single_process), rel=LOSS_RTOL)
    # The checkpoint holds the full, unsharded weights under the single process's names.
    reference, sharded = _final_weights(single_process), _final_weights(out)
    assert sharded.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(sharded[name], value, rtol=0, atol=WEIGHT_ATOL, msg=name)
    # Evaluation ran on every rank without collectives and agrees with the single process.
    single = json.loads((single_process / "summary.json").read_text())
    for task, report in single["eval"].items():
        assert summary["eval"][task]["ne"] == pytest.approx(report["ne"], rel=1e-4)


TABLE_ATOL = 1e-4
"""Tables under row-wise Adagrad, after 6 steps: see the test."""

ROW_WISE_TABLES = ["--set", "model.embedding_optimizer.dense_tables=same",
                   "--set", "model.embedding_optimizer.lr=0.1"]  # after SMALL's pins: they win
# Per-id offsets (model.id_bias) ride along, stepped as the default (``fisher``) steps them, under
# a prior learned from every rank's offsets (an all-reduce over the shards): by
# their summed residual over the step's impressions on all ranks (a rank that counted only its
# own would step half as far), divided by a per-offset state that DCP saves with the run.
ID_BIAS = ["--set", 'model.id_bias=["item"]', "--set", "model.id_bias_rate=0.5",
           "--set", "model.id_bias_prior=learned"]


@pytest.mark.distributed
@pytest.mark.parametrize("sharding, ranks, extra", [
    ("fsdp2", 2, []),
    # HSDP's tables are DTensors on a 2-D mesh (replicated x sharded): the per-row state too.
    pytest.param("hsdp", 4, HSDP_2X2, marks=pytest.mark.slow),
])
def test_row_wise_tables_on_sharded_ranks_match_one_process(gem, tmp_path, sharding, ranks,
                                                            extra):
    """``dense_tables = "same"``: the tables' row-wise Adagrad runs in the dense step on FSDP2's
    dim-0 shards, with its per-row state a DTensor that DCP saves and loads back (the run stops
    at step 3 and resumes), and follows the one-process trajectory. So do the per-id offsets
    of ``model.id_bias``, stepped per impression of the global batch with their per-offset
    state sharded like them."""
    single = tmp_path / "single"
    result = gem("train", "--out", str(single), *SMALL, *ROW_WISE_TABLES, *ID_BIAS)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / sharding
    command = ["train", "--out", str(out), "--nproc-per-node", str(ranks), "--sharding", sharding,
               *extra, *SMALL, *ROW_WISE_TABLES, *ID_BIAS]
    result = gem(*command, "--until-step", "3", env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    result = gem(*command, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stderr
    assert _losses(out) == pytest.approx(_losses(single), rel=LOSS_RTOL)
    reference, sharded = _final_weights(single), _final_weights(out)
    tables = [k for k in reference if k.startswith("embeddings.tables.")]
    assert tables
    assert reference["id_bias.offsets.item"].abs().max() > 0.05  # the offsets moved
    for name, value in reference.items():
        # Row-wise Adagrad divides a row's gradient by the root of its own sum of squares, so a
        # row seen with tiny gradients still takes a step of about lr whose relative error is
        # the gradient's (the reduce-scatter's order of sums): measured 1.4e-5 at most.
        atol = TABLE_ATOL if name in tables else WEIGHT_ATOL
        torch.testing.assert_close(sharded[name], value, rtol=0, atol=atol, msg=name)
    from gem_core.checkpoint.checkpointer import read_checkpoint

    states = [read_checkpoint(run / "checkpoints" / "step-00000006")["engine"]["optimizer"]["state"]
              for run in (single, out)]
    for name in tables:  # the per-row state, whole, under the one process's names
        assert states[1][name]["momentum1"].shape == (reference[name].shape[0],)
        torch.testing.assert_close(states[1][name]["momentum1"], states[0][name]["momentum1"],
                                   rtol=1e-4, atol=1e-9, msg=name)


def test_hsdp_mesh_shape_comes_from_options_and_must_cover_the_ranks():
    from gem_core.distributed import ParallelContext
    from gem_core.errors import GemConfigError
    from gem_core.plugins import build_plugins
    from gem_parallel.fsdp import HsdpOptions, hsdp_mesh_shape

    two_nodes = ParallelContext(world_size=8, local_world_size=4)
    assert hsdp_mesh_shape(HsdpOptions(), two_nodes) == (2, 4)  # shard within a node
    assert hsdp_mesh_shape(HsdpOptions(), ParallelContext(world_size=4)) == (1, 4)  # one node
    assert hsdp_mesh_shape(HsdpOptions(dp_shard=2), two_nodes) == (4, 2)  # options win
    assert hsdp_mesh_shape(HsdpOptions(dp_replicate=4), ParallelContext(world_size=4)) == (4, 1)
    with pytest.raises(GemConfigError, match=r"dp_replicate \(1\) x dp_shard \(4\) must equal"):
        hsdp_mesh_shape(HsdpOptions(dp_shard=4), ParallelContext(world_size=2))
    with pytest.raises(GemConfigError, match="unknown key 'parallel.dense.shards'"):
        build_plugins().resolve("dense_sharding", "hsdp", None, {"shards": 2})


def test_sharded_strategies_refuse_a_single_process_and_unknown_options():
    from gem_core.distributed import ParallelContext
    from gem_core.plugins import build_plugins
    from gem_parallel.fsdp import FsdpOptions, FullyShardedStrategy, HsdpOptions

    model = torch.nn.Linear(2, 2)
    for strategy, options in ((FullyShardedStrategy(hybrid=False), FsdpOptions()),
                              (FullyShardedStrategy(hybrid=True), HsdpOptions())):
        with pytest.raises(RuntimeError, match="has one process"):
            strategy.apply(model, ctx=ParallelContext(), make_optimizer=None, precision=None,
                           options=options)
    with pytest.raises(ValueError, match="dense_sharding 'deepspeed-zero1' takes no options"):
        build_plugins().resolve("dense_sharding", "deepspeed-zero1", None, {"stage": 2})


@pytest.mark.distributed
def test_deepspeed_computes_in_bf16_when_the_recipe_asks(gem, tmp_path):
    """bf16 recipe: DeepSpeed's bf16 mode (bf16 parameters and gradients, fp32 masters in the
    ZeRO optimizer) against one process under bf16 autocast. Rounding differs (bf16 weights vs
    fp32 weights cast per op), so the tolerance is bf16-sized: 5e-3 relative over 4 steps
    (measured: about 1e-3)."""
    short = [*SMALL, "--set", "train.steps=4", "--set", "train.checkpoint_every=0",
             "--precision", "bf16"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert gem("train", "--out", str(one), *short).returncode == 0
    result = gem("train", "--out", str(two), "--nproc-per-node", "2", "--sharding",
                 "deepspeed-zero2", *short, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _losses(two) == pytest.approx(_losses(one), rel=5e-3)
