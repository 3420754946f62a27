"""``gem train --preset tiny-moe`` with expert parallelism (``ep``) on 2 and 4 CPU ranks:
same losses, expert loads and dropped tokens as data parallelism (``ddp``, every expert on every
rank) over the same batches; a stopped ``ep`` run resumes on its trajectory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SMALL = ["--set", "train.steps=6", "--set", "train.batch_size=64", "--set", "data.eval_rows=256",
         "--set", "train.eval_batch_size=256", "--set", "train.warmup_steps=2",
         "--set", "train.eval_every=0", "--set", "train.checkpoint_every=3",
         "--set", "data.max_seq_len=48", "--no-progress"]
# Same batches and math; only float32 summation order differs (all-to-all vs local experts,
# reduce-scatter vs all-reduce).
LOSS_RTOL = 1e-5


def gem(*args: str, timeout: float = 240,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    process = subprocess.Popen([sys.executable, "-m", "gem_core.cli.main", *args], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the launcher and its ranks
        stdout, stderr = process.communicate()
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


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
NO_DROP = ["--set", "model.moe.capacity_factor=0", "--set", "model.moe.aux_loss_weight=0"]


@pytest.fixture(scope="module")
def ddp_no_drop(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ddp") / "run"
    result = _train(out, 2, "ddp", *NO_DROP)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.distributed
def test_ep_on_two_ranks_trains_and_resumes_like_data_parallel(tmp_path, ddp_no_drop):
    ep = tmp_path / "ep"
    result = _train(ep, 2, "ep", *NO_DROP, "--until-step", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    result = _train(ep, 2, "ep", *NO_DROP)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stderr
    _assert_same_training(ep, ddp_no_drop)
    summary = json.loads((ep / "summary.json").read_text())
    assert summary["backends"]["dense_sharding"]["name"] == "ep"
    assert summary["run"]["world_size"] == 2


@pytest.mark.distributed
@pytest.mark.slow
def test_ep_on_four_ranks_with_two_expert_copies_drops_like_data_parallel(tmp_path):
    """4 ranks as 2 copies (edp) of ep 2, with the preset's capacity: tokens are dropped and
    counted exactly as with ddp (capacity is per rank in both)."""
    ddp, ep = tmp_path / "ddp", tmp_path / "ep"
    result = _train(ddp, 4, "ddp")
    assert result.returncode == 0, result.stderr[-3000:]
    result = _train(ep, 4, "ep", "--set", "parallel.dense.ep_size=2")
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_same_training(ep, ddp)
    assert json.loads((ep / "summary.json").read_text())["moe"]["dropped_tokens"] > 0


def test_ep_refuses_models_without_moe_and_uneven_experts():
    import torch

    from gem_core.distributed import ParallelContext
    from gem_core.errors import GemConfigError
    from gem_parallel.expert_parallel import ExpertParallelStrategy, shard_experts
    from gem_core.model.moe import MixtureOfExperts

    strategy = ExpertParallelStrategy()
    with pytest.raises(RuntimeError, match="has one process"):
        strategy.apply(torch.nn.Linear(2, 2), ctx=ParallelContext(), make_optimizer=None,
                       precision=None, options={})
    with pytest.raises(GemConfigError, match="needs a model with MoE layers"):
        shard_experts(torch.nn.Linear(2, 2), group=None, ep_rank=0, ep_size=2)
    layer = MixtureOfExperts("swiglu", 4, 8, 4, num_experts=3, top_k=1, capacity_factor=0,
                             shared_expert=False, aux_loss_weight=0.0, impl="grouped")
    with pytest.raises(GemConfigError, match="3 experts, which 2 expert-parallel ranks cannot"):
        shard_experts(layer, group=None, ep_rank=0, ep_size=2)


# DeepSpeed JIT-builds a small communication op once per cache (about 22 s); share the Makefile's.
DS_ENV = {"TORCH_EXTENSIONS_DIR": os.environ.get(
    "TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[3] / ".cache/torch_extensions"))}


@pytest.mark.distributed
def test_deepspeed_moe_trains_tiny_moe_like_data_parallel(tmp_path, ddp_no_drop):
    ds = tmp_path / "ds"
    result = _train(ds, 2, "deepspeed-moe", *NO_DROP, env=DS_ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    # DeepSpeed's gate picks the same experts from the same router weights.
    _assert_same_training(ds, ddp_no_drop)
    assert all(r["moe_dropped_tokens"] == 0 for r in _records(ds))
    summary = json.loads((ds / "summary.json").read_text())
    assert summary["backends"]["dense_sharding"]["name"] == "deepspeed-moe"


@pytest.mark.distributed
@pytest.mark.slow
def test_deepspeed_moe_on_four_ranks_matches_one_process(tmp_path):
    """4 ranks, DeepSpeed expert groups of 2 (two copies of every expert)."""
    one, ds = tmp_path / "one", tmp_path / "ds"
    result = gem("train", "--preset", "tiny-moe", "--out", str(one), *NO_DROP, *SMALL)
    assert result.returncode == 0, result.stderr[-3000:]
    result = _train(ds, 4, "deepspeed-moe", *NO_DROP, "--set", "parallel.dense.ep_size=2",
                    env=DS_ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_same_training(ds, one)


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
