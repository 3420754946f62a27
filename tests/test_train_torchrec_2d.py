"""``[parallel.embedding] layout = "2d"``: TorchRec's 2D sparse layout end to end.

One 4-rank run (one torchrun agent, gloo) in 2 sharding groups of 2 ranks trains with the
tables model parallel inside each group and replicated across the groups, the replicas averaged
after every step, and stops at its step-2 checkpoint; the checkpoint resumes on one process
(one group of one rank: another number of groups). With fused SGD, averaging the groups'
updates is the update of the whole batch, so every loss equals one process's on the same global
batches. The sparse learning rate is large (5) so that the replicas' average matters: without it
(``sync_every = 3``) step 2's loss is 1.2e-4 off (measured), 10x the tolerance. The same run's
measured shard sizes check ``gem plan``'s figures for the layout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

RUN = ["--preset", "tiny", "--embedding-sharding", "torchrec",
       "--set", "parallel.embedding.optimizer=sgd", "--set", "parallel.embedding.lr=5.0",
       "--set", "train.steps=4", "--set", "train.batch_size=32", "--set", "data.eval_rows=256",
       "--set", "train.eval_batch_size=256", "--set", "train.warmup_steps=1",
       "--set", "train.eval_every=0", "--set", "train.checkpoint_every=2",
       "--set", "data.max_seq_len=16", "--set", "model.interaction_dims=[16]", "--no-progress"]
TWO_D = ["--set", "parallel.embedding.layout=2d"]
# One process and 2 x 2 ranks differ in the order of float32 sums (all-to-alls inside a group,
# the replicas' all-reduce, DDP's): losses agree to 1e-5 relative (measured: about 1e-7).
LOSS_RTOL = 1e-5


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"]
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def runs(gem, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("torchrec_2d")
    one, two_d, resumed = root / "one", root / "two_d", root / "resumed"
    result = gem("train", "--out", str(one), *RUN)
    assert result.returncode == 0, result.stderr[-3000:]
    result = gem("train", "--out", str(two_d), "--nproc-per-node", "4", "--sharding", "ddp",
                 *RUN, *TWO_D, "--set", "parallel.embedding.sharding_group_size=2",
                 "--until-step", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    two_d_log = result.stderr
    shutil.copytree(two_d, resumed)
    result = gem("train", "--out", str(resumed), *RUN, *TWO_D,
                 "--set", "parallel.embedding.sharding_group_size=1")
    assert result.returncode == 0, result.stderr[-3000:]
    return {"one": one, "two_d": two_d, "resumed": resumed, "two_d_log": two_d_log,
            "resume_log": result.stderr}


@pytest.mark.distributed
@pytest.mark.slow
def test_two_groups_of_two_train_as_one_process(runs):
    summary = _summary(runs["two_d"])
    assert summary["run"]["world_size"] == 4
    report = summary["embedding_sharding"]
    layout = report["sparse_layout"]
    # TorchRec's strided groups: the replicas of a shard are neighbouring ranks.
    assert layout["group_ranks"] == [[0, 2], [1, 3]]
    assert ("torchrec layout 2d: 2 sharding group(s) of 2 ranks [[0, 2], [1, 3]], replicas "
            "averaged every 1 step(s)") in runs["two_d_log"]
    assert (layout["sharding_group_size"], layout["sharding_groups"]) == (2, 2)
    # Rank 0's plan places every shard on its group's ranks; something is split over both.
    ranks = [set(info["ranks"]) for info in report["plan"].values()]
    assert set().union(*ranks) == {0, 2} and {0, 2} in ranks
    # Averaged before step 2's lookups and before the step-2 evaluation and checkpoint.
    assert layout["syncs"] == 2
    assert _losses(runs["two_d"]) == pytest.approx(_losses(runs["one"])[:2], rel=LOSS_RTOL)


@pytest.mark.distributed
@pytest.mark.slow
def test_checkpoint_holds_each_shard_once(runs):
    import torch.distributed.checkpoint as dcp

    engine = runs["two_d"] / "checkpoints" / "step-00000002" / "engine"
    saved = dcp.FileSystemReader(engine).read_metadata().state_dict_metadata
    plan = _summary(runs["two_d"])["embedding_sharding"]["plan"]
    for table, info in plan.items():
        chunks = saved[f"model.embeddings.tables.{table}.weight"].chunks
        # Both groups hold these shards; DCP wrote each once.
        assert sorted(tuple(c.offsets) for c in chunks) == \
            sorted(tuple(s["offsets"]) for s in info["shards"])


@pytest.mark.distributed
@pytest.mark.slow
def test_two_d_checkpoint_resumes_on_one_process(runs):
    summary = _summary(runs["resumed"])
    assert summary["run"]["resumed_from"] == 2 and summary["run"]["finished"]
    assert summary["run"]["world_size"] == 1
    assert "resharded from 4 to 1 ranks" in runs["resume_log"]
    assert "1 sharding group(s) of 1 ranks [[0]], no replicas" in runs["resume_log"]
    assert summary["embedding_sharding"]["sparse_layout"]["sharding_groups"] == 1
    assert _losses(runs["resumed"]) == pytest.approx(_losses(runs["one"]), rel=LOSS_RTOL)


@pytest.mark.distributed
@pytest.mark.slow
def test_plan_figures_match_the_measured_shards(runs):
    """``gem plan``'s per-rank memory and replica traffic for this layout, against the bytes
    every rank of the 2 x 2 run held (weights; SGD keeps no optimizer state)."""
    from gem_core.config import load_config
    from gem_core.plugins import build_plugins
    from gem_parallel.plan import Layout, plan

    summary = _summary(runs["two_d"])
    report = summary["embedding_sharding"]
    config = load_config(preset="tiny", overrides=[
        a for a in RUN[RUN.index("--set"):] if a not in ("--set", "--no-progress")])
    options = {"optimizer": "sgd", "lr": 5.0, "layout": "2d", "sharding_group_size": 2}
    planned = plan(config, Layout(gpus=4, gpu_memory_gib=1, dense="ddp",
                                  embedding_options=options), build_plugins())
    memory = planned["memory_bytes_per_rank"]
    expected = memory["embedding_params"] + memory["embedding_optimizer"]
    measured = [sum(rank.values()) for rank in report["shard_bytes_per_rank"]]
    assert len(measured) == 4 and memory["embedding_optimizer"] == 0
    for held in measured:
        assert held == pytest.approx(expected, rel=0.10)
    # Each group holds every table once.
    assert measured[0] + measured[2] == measured[1] + measured[3] == \
        planned["parameters"]["embedding"] * 4
    sync = planned["communication_bytes_per_rank_per_step"]["embedding_sync"]
    # A ring all-reduce over 2 replicas sends the rank's shards once per step.
    assert sync == pytest.approx(report["sparse_layout"]["sync_bytes_per_rank"], rel=0.10)
    assert planned["sparse_layout"]["sharding_groups"] == 2
