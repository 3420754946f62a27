"""``gem train --preset tiny-moe`` with expert parallelism (``ep``, ``deepspeed-moe``) on 1, 2
and 4 CPU ranks: same losses, gradient norms, expert loads and dropped tokens as data parallelism
(``ddp``, every expert on every rank) or one process over the same batches; a stopped ``ep`` run
resumes on its trajectory.

Starting torchrun and its ranks costs more than these short runs: the runs that share a world
size train one after another in one launch (:mod:`gem_core.testing.sequential_runs`), and the
one-process ``ep`` runs train in this process. DeepSpeed keeps its groups from one run to the
next, so each ``deepspeed-moe`` run is a ``gem train`` of its own."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gem_core.testing.processes import run_process_group

SMALL_SETS = ["train.steps=6", "train.batch_size=64", "data.eval_rows=256",
              "train.eval_batch_size=256", "train.warmup_steps=2", "train.eval_every=0",
              "train.checkpoint_every=3", "data.max_seq_len=48"]
SMALL = [*(arg for key in SMALL_SETS for arg in ("--set", key)), "--no-progress"]
# Same batches and math; only float32 summation order differs (all-to-all vs local experts,
# reduce-scatter vs all-reduce).
LOSS_RTOL = 1e-5


def gem(*args: str, timeout: float = 600,
        env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess:
    """``gem ARGS`` in a subprocess; ``env`` adds variables to this one's (None removes one).
    The timeout is for a hang: a loaded CI machine takes minutes to start a few ranks."""
    merged = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    env = {k: v for k, v in merged.items() if v is not None}
    return run_process_group([sys.executable, "-m", "gem_core.cli.main", *args],
                             timeout=timeout, env=env)


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _train(out: Path, ranks: int, sharding: str, *extra: str,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return gem("train", "--preset", "tiny-moe", "--out", str(out), "--nproc-per-node",
               str(ranks), "--sharding", sharding, *extra, *SMALL, env=env)


def _assert_same_training(got_dir: Path, want_dir: Path) -> None:
    want, got = _records(want_dir), _records(got_dir)
    assert len(got) == len(want) == 6
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=LOSS_RTOL)
    # The global gradient norm (before clipping): every expert's gradient counted once.
    assert [r["grad_norm"] for r in got] == \
        pytest.approx([r["grad_norm"] for r in want], rel=LOSS_RTOL)
    for mine, theirs in zip(got, want):
        assert mine["moe_tokens_per_expert"] == theirs["moe_tokens_per_expert"]
        assert mine["moe_dropped_tokens"] == theirs["moe_dropped_tokens"]
    summary = json.loads((got_dir / "summary.json").read_text())
    reference = json.loads((want_dir / "summary.json").read_text())
    assert summary["moe"]["dropped_tokens"] == reference["moe"]["dropped_tokens"]
    # Active experts only, whatever layer runs them (DeepSpeed's counts as gem's).
    assert summary["flops"]["per_step"] == reference["flops"]["per_step"]
    for task, report in reference["eval"].items():  # evaluation on the gathered replica
        assert summary["eval"][task]["ne"] == pytest.approx(report["ne"], rel=1e-4)


# DeepSpeed's MoE runs only without a capacity limit on jagged batches (see deepspeed_moe);
# its load-balancing loss differs from gem's (first choices only), so it is off: then ddp, ep
# and deepspeed-moe all compute the same function.
NO_DROP_SETS = ["model.moe.capacity_factor=0", "model.moe.aux_loss_weight=0"]
NO_DROP = [arg for key in NO_DROP_SETS for arg in ("--set", key)]
EXPERT_FSDP = ["parallel.dense.ep_size=1", "parallel.dense.expert_fsdp=true"]
EP_SIZE_2 = ["parallel.dense.ep_size=2"]
# The feature tables stepped row-wise in the dense step (gem_core.train.table_optimizer): on ep
# they are FSDP2 shards and their per-row state goes through ep's per-rank checkpoint.
ROW_WISE_TABLES = [*NO_DROP_SETS, "model.embedding_optimizer.dense_tables=same",
                   "model.embedding_optimizer.lr=0.1"]


def _train_in_sequence(tmp: Path, ranks: int,
                       runs: list[tuple[str, str, list[str], int | None]]) -> str:
    """Train ``runs`` (run directory name under ``tmp``, sharding, config overrides, until step)
    one after another on ``ranks`` ranks of one torchrun launch; returns its stderr."""
    spec = [{"out": str(tmp / name), "preset": "tiny-moe",
             "overrides": [*SMALL_SETS, f"backends.dense_sharding={sharding}", *sets],
             "until_step": until_step} for name, sharding, sets, until_step in runs]
    (tmp / "runs.json").write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = run_process_group(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={ranks}", "-m", "gem_core.testing.sequential_runs",
         str(tmp / "runs.json")], timeout=1200, env=env)
    assert result.returncode == 0, result.stderr[-5000:]
    return result.stderr


def _assert_resumed_at_step_3(stderr: str, run_dir: Path) -> None:
    assert re.search(rf"resumed from {re.escape(str(run_dir))}/checkpoints/\S+ at step 3\b",
                     stderr), f"{run_dir} did not resume at step 3"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, str]:
    """One launch of 2 ranks: ``ddp`` (the reference), ``ep`` stopped at step 3 and resumed,
    the same with ``ep_size`` 1 and expert_fsdp, and ``ddp`` and ``ep`` (stopped and resumed)
    with row-wise tables; all without drops. (directory, stderr)."""
    tmp = tmp_path_factory.mktemp("two_ranks")
    stderr = _train_in_sequence(tmp, 2, [
        ("ddp", "ddp", NO_DROP_SETS, None),
        ("ep", "ep", NO_DROP_SETS, 3), ("ep", "ep", NO_DROP_SETS, None),
        ("ep_fsdp", "ep", [*NO_DROP_SETS, *EXPERT_FSDP], 3),
        ("ep_fsdp", "ep", [*NO_DROP_SETS, *EXPERT_FSDP], None),
        ("ddp_rows", "ddp", ROW_WISE_TABLES, None),
        ("ep_rows", "ep", ROW_WISE_TABLES, 3), ("ep_rows", "ep", ROW_WISE_TABLES, None)])
    return tmp, stderr


@pytest.fixture(scope="module")
def ddp_no_drop(two_ranks) -> Path:
    return two_ranks[0] / "ddp"


@pytest.mark.distributed
def test_ep_on_two_ranks_trains_and_resumes_like_data_parallel(two_ranks, ddp_no_drop):
    tmp, stderr = two_ranks
    ep = tmp / "ep"
    _assert_resumed_at_step_3(stderr, ep)
    _assert_same_training(ep, ddp_no_drop)
    summary = json.loads((ep / "summary.json").read_text())
    assert summary["backends"]["dense_sharding"]["name"] == "ep"
    assert summary["run"]["world_size"] == 2


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> Path:
    """One launch of 4 ranks: ``ddp`` and ``ep`` with ``ep_size`` 2 (2 expert copies), with
    and without expert_fsdp, at the preset's capacity (drops); ``ep`` at ep_size 4 without."""
    tmp = tmp_path_factory.mktemp("four_ranks")
    _train_in_sequence(tmp, 4, [
        ("ddp", "ddp", [], None), ("ep", "ep", EP_SIZE_2, None),
        ("ep_fsdp", "ep", [*EP_SIZE_2, "parallel.dense.expert_fsdp=true"], None),
        ("ep_4_no_drop", "ep", NO_DROP_SETS, None)])
    return tmp


@pytest.mark.distributed
@pytest.mark.slow
def test_ep_on_four_ranks_with_two_expert_copies_drops_like_data_parallel(four_ranks):
    """4 ranks as 2 copies (edp) of ep 2, with the preset's capacity: tokens are dropped and
    counted exactly as with ddp (capacity is per rank in both)."""
    ddp, ep, ep_fsdp = four_ranks / "ddp", four_ranks / "ep", four_ranks / "ep_fsdp"
    _assert_same_training(ep, ddp)
    assert json.loads((ep / "summary.json").read_text())["moe"]["dropped_tokens"] > 0
    # The same with each rank's 2 experts FSDP-sharded over their 2 copies (expert_fsdp): the
    # all-to-all and the expert all-gathers / reduce-scatters in one run.
    _assert_same_training(ep_fsdp, ddp)


@pytest.mark.distributed
def test_ep_with_experts_fsdp_sharded_over_their_copies_trains_and_resumes(two_ranks,
                                                                           ddp_no_drop):
    """2 ranks, ep_size 1 and expert_fsdp: every rank has all 4 experts in its layers, but
    stores half of each stack (FSDP over the 2 copies); stopped at step 3 and resumed (the
    checkpoint gathers the shards, loading scatters them back)."""
    tmp, stderr = two_ranks
    ep = tmp / "ep_fsdp"
    _assert_resumed_at_step_3(stderr, ep)
    _assert_same_training(ep, ddp_no_drop)


@pytest.mark.distributed
def test_ep_steps_row_wise_tables_and_resumes_their_state(two_ranks, ddp_no_drop):
    """``dense_tables = "same"`` on ``ep``: the tables' row-wise Adagrad runs on their FSDP2
    shards; the per-row state, saved per rank, is loaded back as a DTensor of one value per row
    (stopped at step 3 and resumed) and the run follows ``ddp``'s with the same tables."""
    from gem_core.checkpoint.checkpointer import read_checkpoint

    tmp, stderr = two_ranks
    ep, ddp = tmp / "ep_rows", tmp / "ddp_rows"
    _assert_resumed_at_step_3(stderr, ep)
    _assert_same_training(ep, ddp)
    # The tables' optimizer changed the trajectory: this is not AdamW's run again.
    assert [r["loss"] for r in _records(ep)][1:] != \
        pytest.approx([r["loss"] for r in _records(ddp_no_drop)][1:], rel=1e-3)
    last = sorted((ep / "checkpoints").glob("step-*"))[-1]
    per_rank = read_checkpoint(last)["engine"]["optimizer"]["per_rank"]
    momenta = [value["momentum1"] for rank in per_rank for value in rank["state"].values()
               if "momentum1" in value]
    assert momenta and all(m.dim() == 1 and m.abs().sum() > 0 for m in momenta)


def test_ep_refuses_models_without_moe_and_uneven_experts():
    import torch
    import torch.distributed as dist

    from gem_core.distributed import ParallelContext
    from gem_core.errors import GemConfigError
    from gem_core.model.moe import MixtureOfExperts
    from gem_core.testing.models import LayersInterface
    from gem_parallel.expert_parallel import EpOptions, ExpertParallelStrategy, shard_experts

    class Dense(torch.nn.Sequential, LayersInterface):
        pass

    strategy = ExpertParallelStrategy()
    with pytest.raises(GemConfigError, match="needs a model with MoE layers"):
        strategy.apply(Dense(torch.nn.Linear(2, 2)), ctx=ParallelContext(), make_optimizer=None,
                       precision=None, options=EpOptions())
    assert not dist.is_initialized()  # refused before starting a process group
    with pytest.raises(GemConfigError, match="needs a model with MoE layers"):
        shard_experts(Dense(torch.nn.Linear(2, 2)), group=None, ep_rank=0, ep_size=2)
    # A model without the strategy interface is refused by name.
    with pytest.raises(GemConfigError, match=r"Linear\.moe_layers\(\) of the model interface"):
        strategy.apply(torch.nn.Linear(2, 2), ctx=ParallelContext(), make_optimizer=None,
                       precision=None, options=EpOptions())
    layer = MixtureOfExperts("swiglu", 4, 8, 4, num_experts=3, top_k=1, capacity_factor=0,
                             shared_expert=False, aux_loss_weight=0.0, impl="grouped")
    with pytest.raises(GemConfigError, match="3 experts, which 2 expert-parallel ranks cannot"):
        shard_experts(layer, group=None, ep_rank=0, ep_size=2)


# DeepSpeed JIT-builds a small communication op once per cache (about 22 s); share the Makefile's.
DS_ENV = {"TORCH_EXTENSIONS_DIR": os.environ.get(
    "TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[3] / ".cache/torch_extensions"))}


@pytest.mark.distributed
def test_deepspeed_moe_trains_tiny_moe_like_data_parallel(tmp_path, ddp_no_drop):
    """Stopped after step 3 and resumed: the full-state checkpoint (gem's names, every rank's
    ZeRO partitions) must restore DeepSpeed's layers, experts and optimizer state; then it is
    refused under another expert layout."""
    ds = tmp_path / "ds"
    result = _train(ds, 2, "deepspeed-moe", *NO_DROP, "--until-step", "3", env=DS_ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    result = _train(ds, 2, "deepspeed-moe", *NO_DROP, env=DS_ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stderr
    # DeepSpeed's gate picks the same experts from the same router weights.
    _assert_same_training(ds, ddp_no_drop)
    assert all(r["moe_dropped_tokens"] == 0 for r in _records(ds))
    summary = json.loads((ds / "summary.json").read_text())
    assert summary["backends"]["dense_sharding"]["name"] == "deepspeed-moe"
    result = _train(ds, 2, "deepspeed-moe", *NO_DROP, "--set", "train.steps=8",
                    "--set", "parallel.dense.ep_size=1", env=DS_ENV)
    assert result.returncode != 0
    assert "expert layout {'ep_size': 2, 'world_size': 2}" in result.stderr


@pytest.mark.distributed
@pytest.mark.slow
def test_deepspeed_moe_on_four_ranks_matches_one_process(tmp_path, none_no_drop):
    """4 ranks, DeepSpeed expert groups of 2 (two copies of every expert)."""
    ds = tmp_path / "ds"
    result = _train(ds, 4, "deepspeed-moe", *NO_DROP, "--set", "parallel.dense.ep_size=2",
                    env=DS_ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_same_training(ds, none_no_drop)


@pytest.mark.distributed
def test_deepspeed_moe_with_a_capacity_drops_and_trains(tmp_path):
    """The preset as it is (capacity 1.25, top-2): ranks hold different numbers of tokens, so
    the capacity comes from the expert group's largest rank (otherwise gloo's all-to-all fails
    on mismatched buffers); DeepSpeed drops over it and the drops are counted."""
    ds = tmp_path / "ds"
    result = _train(ds, 2, "deepspeed-moe", env=DS_ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    records = _records(ds)
    assert len(records) == 6 and all(math.isfinite(r["loss"]) for r in records)
    summary = json.loads((ds / "summary.json").read_text())
    assert summary["moe"]["dropped_tokens"] == sum(r["moe_dropped_tokens"] for r in records) > 0


def test_deepspeed_moe_explains_what_it_cannot_run():
    pytest.importorskip("deepspeed")
    from gem_core.errors import GemConfigError
    from gem_core.model.moe import MixtureOfExperts
    from gem_parallel.deepspeed_moe import DeepSpeedMoeAdapter

    def layer(capacity: float, out: int = 8) -> MixtureOfExperts:
        return MixtureOfExperts("swiglu", 8, 16, out, num_experts=2, top_k=1,
                                capacity_factor=capacity, shared_expert=False,
                                aux_loss_weight=0.0, impl="grouped")

    with pytest.raises(GemConfigError, match="needs model.moe.capacity_factor = 0"):
        DeepSpeedMoeAdapter(layer(1.25), ep_size=1, ep_rank=0)
    with pytest.raises(GemConfigError, match="cannot replace a 8 -> 12 MoE"):
        DeepSpeedMoeAdapter(layer(0.0, out=12), ep_size=1, ep_rank=0)


def test_deepspeed_moe_in_one_process_refuses_cleanly_and_shutdown_ends_its_group():
    """A refusal after the one-rank group started (capacity > 0 is found while swapping the
    layers): the error is the user's to read, and ``shutdown`` still destroys the group,
    although DeepSpeed never adopted it."""
    pytest.importorskip("deepspeed")
    import torch
    import torch.distributed as dist

    from gem_core.distributed import ParallelContext, shutdown
    from gem_core.errors import GemConfigError
    from gem_core.model.moe import MixtureOfExperts
    from gem_core.precision import Float32Recipe
    from gem_core.testing.models import LayersInterface
    from gem_parallel.deepspeed_moe import DeepSpeedMoeOptions, DeepSpeedMoeStrategy

    class Layers(torch.nn.Sequential, LayersInterface):
        pass

    model = Layers(MixtureOfExperts(
        "swiglu", 8, 16, 8, num_experts=2, top_k=1, capacity_factor=1.25, shared_expert=False,
        aux_loss_weight=0.0, impl="grouped"))
    ctx = ParallelContext()
    try:
        with pytest.raises(GemConfigError, match="needs model.moe.capacity_factor = 0"):
            DeepSpeedMoeStrategy().apply(model, ctx=ctx, make_optimizer=None,
                                         precision=Float32Recipe(), options=DeepSpeedMoeOptions())
        assert dist.is_initialized() and dist.get_world_size() == 1
    finally:
        shutdown(ctx)
    assert not dist.is_initialized()


# -- one process and four ranks with the default expert-parallel size ------------------------------
# One process is the degenerate layout (ep_size 1: every expert local, no all-to-all) over a
# one-rank process group the strategies start themselves; its float32 sums run in the same order
# as --sharding none, except the gradient norm (float64 in the ep engine), which moves the
# clipped update by an ulp or so: losses agree to about 1e-7 (measured), checked to 1e-6.
ONE_PROCESS_RTOL = 1e-6
MOE_KEYS = ("loss", "aux_loss", "moe_tokens_per_expert", "moe_load_max_over_mean",
            "moe_load_max_over_mean_worst", "moe_dropped_tokens")


def _assert_moe_run(run_dir: Path, *, strategy: str, world_size: int) -> list[dict]:
    records = _records(run_dir)
    assert [r["step"] for r in records] == list(range(1, 7))
    for record in records:
        missing = [k for k in MOE_KEYS if k not in record]
        assert not missing, f"{run_dir}: step {record['step']} lacks {missing}"
        assert math.isfinite(record["loss"])
        loads = record["moe_load_max_over_mean"]  # per MoE layer
        assert len(loads) == 2 and all(v >= 1.0 for v in loads.values())
        assert record["moe_load_max_over_mean_worst"] == max(loads.values())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["backends"]["dense_sharding"]["name"] == strategy
    assert summary["run"]["world_size"] == world_size
    assert all(math.isfinite(report["ne"]) for report in summary["eval"].values())
    return records


def _assert_same_losses(got_dir: Path, want_dir: Path, rel: float) -> None:
    want, got = _records(want_dir), _records(got_dir)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=rel)
    assert [r["grad_norm"] for r in got] == \
        pytest.approx([r["grad_norm"] for r in want], rel=rel)
    for mine, theirs in zip(got, want):
        assert mine["moe_tokens_per_expert"] == theirs["moe_tokens_per_expert"]
        assert mine["moe_dropped_tokens"] == theirs["moe_dropped_tokens"]
    summary = json.loads((got_dir / "summary.json").read_text())
    reference = json.loads((want_dir / "summary.json").read_text())
    for task, report in reference["eval"].items():
        assert summary["eval"][task]["ne"] == pytest.approx(report["ne"], rel=1e-6)


def _train_in_this_process(out: Path, sharding: str, *sets: str,
                           until_step: int | None = None) -> None:
    """What ``gem train --preset tiny-moe`` runs in one process, without starting one: on one
    thread, like the subprocesses (OMP_NUM_THREADS=1), so float32 sums run in their order."""
    import torch

    from gem_core.config import load_config
    from gem_core.plugins import build_plugins
    from gem_core.train.trainer import train

    config = load_config(preset="tiny-moe", overrides=[
        *SMALL_SETS, f"backends.dense_sharding={sharding}", *sets])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(config, build_plugins(), out, progress=False, until_step=until_step)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def none_no_drop(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("none") / "run"
    _train_in_this_process(out, "none", *NO_DROP_SETS)
    return out


def test_ep_on_one_process_trains_and_resumes_like_no_sharding(tmp_path, caplog):
    """The preset as it is (capacity 1.25, load-balancing loss on): same drops, same losses."""
    none, ep = tmp_path / "none", tmp_path / "ep"
    _train_in_this_process(none, "none")
    _train_in_this_process(ep, "ep", until_step=3)
    with caplog.at_level(logging.INFO, logger="gem_core.train.trainer"):
        _train_in_this_process(ep, "ep")
    _assert_resumed_at_step_3(caplog.text, ep)
    records = _assert_moe_run(ep, strategy="ep", world_size=1)
    assert sum(r["moe_dropped_tokens"] for r in records) > 0
    _assert_same_losses(ep, none, ONE_PROCESS_RTOL)


def test_deepspeed_moe_on_one_process_trains_like_no_sharding(tmp_path, none_no_drop,
                                                             monkeypatch):
    """No launcher, no RANK/MASTER_ADDR/...: the strategy brings its own one-rank group, and
    ends it with the run (trained in this process, which the tests after this one share)."""
    import torch.distributed as dist

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)  # and LOCAL_RANK, which DeepSpeed sets, after
    for name, value in DS_ENV.items():
        monkeypatch.setenv(name, value)
    ds = tmp_path / "ds"
    _train_in_this_process(ds, "deepspeed-moe", *NO_DROP_SETS)
    assert not dist.is_initialized()
    _assert_moe_run(ds, strategy="deepspeed-moe", world_size=1)
    _assert_same_losses(ds, none_no_drop, ONE_PROCESS_RTOL)


@pytest.mark.distributed
def test_ep_on_four_ranks_holds_one_expert_each(four_ranks, none_no_drop):
    """4 ranks of ``ep``: ep_size 4, one of tiny-moe's 4 experts per rank.
    Without a capacity limit (and aux loss) the function does not depend on how the batch is
    split, so the losses and loads equal one process's, up to float32 summation order."""
    ep = four_ranks / "ep_4_no_drop"
    _assert_moe_run(ep, strategy="ep", world_size=4)
    want, got = _records(none_no_drop), _records(ep)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=LOSS_RTOL)
    assert [r["grad_norm"] for r in got] == \
        pytest.approx([r["grad_norm"] for r in want], rel=LOSS_RTOL)
    assert [r["moe_tokens_per_expert"] for r in got] == \
        [r["moe_tokens_per_expert"] for r in want]
    # The all-to-all bytes gem plan predicts for this layout (uniform routing, rank 0 at the
    # mean history length) against those rank 0 sent (measured: 1.08x the prediction).
    plan = gem("plan", "--preset", "tiny-moe", "--gpus", "4", "--gpu-memory", "1",
               "--sharding", "ep", *NO_DROP, *[a for a in SMALL if a != "--no-progress"],
               "--json")
    assert plan.returncode == 0, plan.stderr[-3000:]
    predicted = json.loads(plan.stdout)["communication_bytes_per_rank_per_step"]
    measured = json.loads((ep / "summary.json").read_text())["dense_sharding"]
    assert measured["steps_counted"] == 6
    assert 0.8 < measured["all_to_all_bytes_per_step"] / predicted["moe_all_to_all"] < 1.25


def test_ep_strategy_in_one_process_starts_and_shutdown_ends_a_one_rank_group():
    """In the calling process: ``ep`` applied without a launcher starts a one-rank group, the
    layer runs its experts itself (no dispatcher), a step matches the unsharded layer, and
    ``shutdown`` destroys the group, so a second run can start its own."""
    import copy

    import torch
    import torch.distributed as dist
    from torch import nn

    from gem_core.distributed import ParallelContext, shutdown
    from gem_core.model.moe import MixtureOfExperts
    from gem_core.precision import Float32Recipe
    from gem_core.testing.models import LayersInterface
    from gem_parallel.expert_parallel import EpOptions, ExpertParallelStrategy

    class Model(nn.Module, LayersInterface):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = MixtureOfExperts("swiglu", 8, 16, 8, num_experts=4, top_k=2,
                                        capacity_factor=0, shared_expert=True,
                                        aux_loss_weight=0.0, impl="grouped")

        def forward(self, x):
            return self.mlp(x)

    assert not dist.is_initialized()
    torch.manual_seed(0)
    x = torch.randn(24, 8)
    for _ in range(2):  # the second run gets a fresh group
        reference = Model()
        model = copy.deepcopy(reference)
        ctx = ParallelContext()
        engine = ExpertParallelStrategy().apply(
            model, ctx=ctx, make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
            precision=Float32Recipe(), options=EpOptions())
        try:
            assert dist.is_initialized() and dist.get_world_size() == 1
            assert model.mlp.dispatcher is None and model.mlp.experts.gate.shape[0] == 4
            engine.backward(engine(x).square().sum())
            engine.clip_grad_norm(0.0)
            engine.step()
            reference(x).square().sum().backward()
            with torch.no_grad():
                for param in reference.parameters():
                    param -= 0.1 * param.grad
            full = engine.state_dict()["model"]
            for name, param in reference.state_dict().items():
                torch.testing.assert_close(full[name], param, rtol=1e-6, atol=1e-7)
        finally:
            shutdown(ctx)
        assert not dist.is_initialized()
