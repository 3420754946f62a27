"""TorchRec-sharded embedding tables through DCP checkpoints.

The checkpoint holds every table as TorchRec's ShardedTensor under the replicated backend's name
(``model.embeddings.tables.<table>.weight``) and row-wise Adagrad's per-row sums under
``optimizer.state.embeddings.tables.<table>.weight.momentum1``, each rank writing its own shards.
A stop and resume on the same 2 ranks continues bit for bit; 4 ranks (FSDP2 dense) and one
process (TorchRec in a process group of one rank) reshard the tables and their optimizer state:
the evaluation right after loading equals the one saved at that step, and training continues on
the uninterrupted run's losses up to float summation order."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

RUN = ["--embedding-sharding", "torchrec",
       "--set", "train.steps=4", "--set", "train.batch_size=32", "--set", "data.eval_rows=256",
       "--set", "train.eval_batch_size=256", "--set", "train.warmup_steps=1",
       "--set", "train.eval_every=0", "--set", "train.checkpoint_every=2",
       "--set", "data.max_seq_len=16", "--set", "model.interaction_dims=[16]", "--no-progress"]
TWO_DDP = ["--nproc-per-node", "2", "--sharding", "ddp"]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in _metrics(run_dir)]


@pytest.fixture(scope="module")
def runs(gem, tmp_path_factory) -> dict[str, Path]:
    """An uninterrupted 2-rank run and one stopped at step 2 (its checkpoint is the one every
    test resumes from a copy of). The stopped run saves in the background, so the tests cover
    the staging of TorchRec's ShardedTensors too (DCP's own stager cannot copy them)."""
    root = tmp_path_factory.mktemp("torchrec_resume")
    whole, stopped = root / "whole", root / "stopped"
    background = ["--set", "train.async_checkpoint=true"]
    for out, extra in ((whole, []), (stopped, ["--until-step", "2", *background])):
        result = gem("train", "--out", str(out), *TWO_DDP, *extra, *RUN)
        assert result.returncode == 0, result.stderr[-3000:]
    return {"whole": whole, "stopped": stopped}


@pytest.mark.distributed
def test_torchrec_tables_resume_exactly_on_the_same_ranks(gem, tmp_path, runs):
    parts = tmp_path / "parts"
    shutil.copytree(runs["stopped"], parts)
    second = gem("train", "--out", str(parts), *TWO_DDP, *RUN)
    assert second.returncode == 0, second.stderr[-3000:]
    assert json.loads((parts / "summary.json").read_text())["run"]["resumed_from"] == 2
    assert _losses(parts) == _losses(runs["whole"])


@pytest.mark.distributed
def test_checkpoint_holds_each_table_once_as_shards_under_the_replicated_names(runs):
    import torch.distributed.checkpoint as dcp

    engine = runs["stopped"] / "checkpoints" / "step-00000002" / "engine"
    saved = dcp.FileSystemReader(engine).read_metadata().state_dict_metadata
    assert not [k for k in saved if "_extra_state" in k]
    plan = json.loads((runs["whole"] / "summary.json").read_text())["embedding_sharding"]["plan"]
    for table, info in plan.items():
        weight = saved[f"model.embeddings.tables.{table}.weight"]
        # One chunk per shard of the plan: each rank wrote its own, nobody the whole table.
        assert sorted(tuple(c.offsets) for c in weight.chunks) == \
            sorted(tuple(s["offsets"]) for s in info["shards"])
        momentum = saved[f"optimizer.state.embeddings.tables.{table}.weight.momentum1"]
        assert list(momentum.size) == [weight.size[0]]  # one sum per row


@pytest.mark.distributed
@pytest.mark.parametrize("launch, world", [
    pytest.param(["--nproc-per-node", "4", "--sharding", "fsdp2"], 4, id="4-ranks-fsdp2"),
    pytest.param(["--sharding", "none"], 1, id="1-process"),
])
def test_two_rank_torchrec_checkpoint_resumes_on_another_number_of_ranks(gem, tmp_path, runs,
                                                                         launch, world):
    out = tmp_path / "resumed"
    shutil.copytree(runs["stopped"], out)
    result = gem("train", "--out", str(out), *launch, *RUN)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resharded from 2 to {world} ranks" in result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["resumed_from"] == 2 and summary["run"]["finished"]
    assert summary["run"]["world_size"] == world
    ranks = {r for info in summary["embedding_sharding"]["plan"].values() for r in info["ranks"]}
    assert ranks == set(range(world))

    # Predictions before and after: the evaluation saved at step 2 (2 ranks) and the one run
    # right after loading on the new layout.
    at_stop = [e for e in summary["eval_history"] if e["step"] == 2]
    assert len(at_stop) == 2
    for task in ("click", "conversion"):
        assert at_stop[1][task]["ne"] == pytest.approx(at_stop[0][task]["ne"], rel=1e-6, abs=0)
        assert at_stop[1][task]["auc"] == pytest.approx(at_stop[0][task]["auc"], rel=1e-6)

    # Same global batches as the uninterrupted run; losses equal up to summation order
    # (measured: about 5e-8), which also needs the Adagrad sums back (zeroed after loading,
    # step 4's loss is 3e-3 off, measured).
    whole, got = _metrics(runs["whole"]), _metrics(out)
    assert [m["step"] for m in got] == [1, 2, 3, 4]
    assert [(m["samples"], m["tokens"]) for m in got] == \
        [(m["samples"], m["tokens"]) for m in whole]
    for a, b in zip(whole[2:], got[2:], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)


@pytest.mark.distributed
@pytest.mark.parametrize("change, message", [
    (["--embedding-sharding", "replicated"],
     "holds 'embeddings' as 'torchrec' shards with their own sparse optimizer state "
     "(rowwise_adagrad), and this run keeps 'embeddings' in the dense engine, whose optimizer "
     "cannot continue from that state; resume with --embedding-sharding torchrec (any number of "
     "ranks, one process included) or use --fresh"),
    (["--set", "parallel.embedding.optimizer=sgd"],
     "the checkpoint's tables were trained by the fused 'rowwise_adagrad' and this run's "
     "parallel.embedding.optimizer is 'sgd'"),
])
def test_what_a_torchrec_resume_refuses(gem, tmp_path, runs, change, message):
    out = tmp_path / "refused"
    shutil.copytree(runs["stopped"], out)
    result = gem("train", "--out", str(out), "--sharding", "none", *RUN, *change)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
