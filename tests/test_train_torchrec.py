"""``gem train --nproc-per-node 2 --embedding-sharding torchrec`` end to end: TorchRec-sharded
tables (row-wise Adagrad fused in the backward) with DDP and with FSDP2 dense parameters, and
``model.id_bias``'s offsets among the dense ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SMALL = ["--preset", "tiny", "--nproc-per-node", "2", "--embedding-sharding", "torchrec",
         "--set", "train.steps=6", "--set", "train.batch_size=64", "--set", "data.eval_rows=256",
         "--set", "train.eval_batch_size=256", "--set", "train.warmup_steps=2",
         "--set", "train.eval_every=0", "--set", "train.checkpoint_every=3",
         "--set", "data.max_seq_len=48", "--no-progress",
         # Per-id offsets beside the sharded tables: dense parameters of the model (DDP
         # replicates them, FSDP2 shards them), stepped per impression of the global batch.
         "--set", 'model.id_bias=["item"]', "--set", "model.id_bias_rate=0.5"]
# The tables of the synthetic source's schema (tiny preset): event features item and action,
# candidate features item (sharing the event table), advertiser and category, two context features.
TABLES = {"item", "action", "advertiser", "category", "user_segment", "context"}

# DDP and FSDP2 differ only in the order of float32 sums (all-reduce vs reduce-scatter), and
# table-wise and row-wise shards keep whole rows (so row-wise Adagrad's per-row state is the
# same): losses agree to 1e-5 relative (measured: about 2e-7).
LOSS_RTOL = 1e-5


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"]
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def ddp_run(gem, tmp_path_factory) -> tuple[Path, str]:
    """Stopped after step 3 and resumed from its checkpoint: the tables and their Adagrad state
    must come back from it for the run to continue the same trajectory."""
    out = tmp_path_factory.mktemp("torchrec") / "ddp"
    command = ["train", "--out", str(out), "--sharding", "ddp", *SMALL]
    first = gem(*command, "--until-step", "3")
    assert first.returncode == 0, first.stderr[-3000:]
    second = gem(*command)
    assert second.returncode == 0, second.stderr[-3000:]
    return out, first.stderr + second.stderr


@pytest.mark.distributed
def test_ddp_trains_and_reports_the_plan(ddp_run):
    out, log = ddp_run
    assert "resumed from" in log
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["world_size"] == 2 and summary["run"]["finished"]
    assert summary["backends"]["embedding_sharding"]["name"] == "torchrec"
    assert summary["backends"]["dense_sharding"]["name"] == "ddp"
    report = summary["embedding_sharding"]
    assert set(report["plan"]) == TABLES
    for table, info in report["plan"].items():
        assert info["sharding_type"] in ("table_wise", "row_wise", "column_wise")
        assert info["ranks"] and set(info["ranks"]) <= {0, 1}
        assert f"torchrec plan: table {table} {info['sharding_type']}" in log
    assert report["sparse_optimizer"]["name"] == "rowwise_adagrad"
    assert report["sparse_optimizer"]["lr_schedule"] == "constant"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {r["sparse_lr"] for r in records} == {0.02}
    losses = _losses(out)
    assert len(losses) == 6 and losses[-1] < losses[0]
    # The offsets moved, and their per-offset state came back with the resumed run.
    from gem_core.checkpoint.checkpointer import read_checkpoint

    engine = read_checkpoint(out / "checkpoints" / "step-00000006")["engine"]
    assert engine["model"]["id_bias.offsets.item"].abs().max() > 0.05
    fisher = engine["optimizer"]["state"]["id_bias.offsets.item"]["fisher"]
    assert fisher.shape == engine["model"]["id_bias.offsets.item"].shape
    assert int(engine["optimizer"]["state"]["id_bias.offsets.item"]["step"]) == 6


@pytest.mark.distributed
def test_fsdp2_with_a_forced_plan_follows_the_ddp_run(gem, tmp_path, ddp_run):
    reference, _ = ddp_run
    planned = json.loads((reference / "summary.json").read_text())["embedding_sharding"]["plan"]
    # Force every table table-wise, whatever the planner chose for the DDP run.
    forced = [arg for table in sorted(TABLES)
              for arg in ("--set", f"parallel.embedding.plan.{table}=table_wise")]
    out = tmp_path / "fsdp2"
    result = gem("train", "--out", str(out), "--sharding", "fsdp2", *SMALL, *forced)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["backends"]["dense_sharding"]["name"] == "fsdp2"
    plan = summary["embedding_sharding"]["plan"]
    assert {info["sharding_type"] for info in plan.values()} == {"table_wise"}
    # Column-wise shards would keep per-shard row-wise Adagrad state (not the same math); the
    # planner puts tiny's tables whole or by rows on 2 ranks.
    assert {info["sharding_type"] for info in planned.values()} <= {"table_wise", "row_wise"}
    assert _losses(out) == pytest.approx(_losses(reference), rel=LOSS_RTOL)


@pytest.mark.distributed
def test_fsdp2_with_bf16_parameters_takes_the_lookups_in_bf16(gem, tmp_path, ddp_run):
    """FSDP2's bf16 policy computes the dense part in bf16 (the replicated tables too); the
    TorchRec tables stay float32 and their lookups are handed on in bf16 (without that cast the
    model's bf16 and float32 tokens do not mix)."""
    reference, _ = ddp_run
    out = tmp_path / "bf16"
    result = gem("train", "--out", str(out), "--sharding", "fsdp2", "--precision", "bf16",
                 *SMALL)
    assert result.returncode == 0, result.stderr[-3000:]
    # bf16 rounding only: within 1 % of the float32 run's losses (measured: about 0.1 %).
    assert _losses(out) == pytest.approx(_losses(reference), rel=1e-2)


def test_one_process_follows_the_dense_schedule(gem, tmp_path):
    """One process runs the tables in a one-rank group; with ``lr_schedule = "dense"`` the
    sparse learning rate of every step is the configured one times the dense schedule's
    factor (warmup, then decay)."""
    out = tmp_path / "one"
    one = [arg for arg in SMALL if arg not in ("--nproc-per-node", "2")]
    result = gem("train", "--out", str(out), *one, "--set", "train.checkpoint_every=0",
                 "--set", "parallel.embedding.lr=0.04",
                 "--set", "parallel.embedding.lr_schedule=dense")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["world_size"] == 1 and summary["run"]["finished"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    base = summary["config"]["train"]["lr"]
    assert [r["sparse_lr"] for r in records] == pytest.approx(
        [0.04 * r["lr"] / base for r in records], rel=1e-12)
    assert records[0]["sparse_lr"] < records[1]["sparse_lr"]  # warmup
