"""``gem train --nnodes 2``: two torchrun agents on 127.0.0.1 (two "nodes" of 2 gloo ranks each)
meeting at a c10d rendezvous, as two machines would.

One 2 x 2 run trains with TorchRec-sharded tables, the two pooled tables forced
``table_row_wise`` (a table on one node, its rows split over that node's ranks; the planner
gets the launch's node layout), and stops at its step-2 checkpoint; its losses equal one
process's on the same global batches, and the checkpoint resumes in one process onto the
uninterrupted run's losses; a second 2 x 2 launch resumes that checkpoint through TorchRec's
``sparse-dist`` train pipeline (the ranks' batches differ in size: the pipeline's lookups are
padded as the plain forward's, which gloo needs) onto the same losses. The launch's bad
inputs (an endpoint that never answers, agents started with different --nnodes) fail within
--rdzv-timeout with messages naming the endpoint.
The HSDP mesh default (replicate across nodes, shard within one) is checked on a fake 4-rank
group in this process."""

from __future__ import annotations

import json
import re
import shutil
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gem_core.testing.processes import run_process_group

RUN = ["--preset", "tiny", "--embedding-sharding", "torchrec",
       "--set", "train.steps=4", "--set", "train.batch_size=32", "--set", "data.eval_rows=256",
       "--set", "train.eval_batch_size=256", "--set", "train.warmup_steps=1",
       "--set", "train.eval_every=0", "--set", "train.checkpoint_every=2",
       "--set", "data.max_seq_len=16", "--set", "model.interaction_dims=[16]", "--no-progress"]
# The tiny preset's pooled (context) tables; sequence tables cannot be table_row_wise.
ROW_WISE_PER_NODE = ["--set", "parallel.embedding.plan.user_segment=table_row_wise",
                     "--set", "parallel.embedding.plan.context=table_row_wise"]
# One process and 2 x 2 ranks differ only in the order of float32 sums (all-to-alls, the
# reduce-scatter inside a node, DDP's all-reduce): losses agree to 1e-5 relative (measured:
# about 5e-8).
LOSS_RTOL = 1e-5


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _agents(*commands: list[str], timeout: float) -> list:
    """Run one ``gem`` per command at once (each a node's agent); their results in order."""
    with ThreadPoolExecutor(len(commands)) as pool:
        futures = [pool.submit(run_process_group,
                               [sys.executable, "-m", "gem_core.cli.main", *command],
                               timeout=timeout) for command in commands]
        return [future.result() for future in futures]


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"]
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(gem, tmp_path_factory) -> dict[str, Path]:
    """One process for 4 steps; 2 nodes x 2 ranks stopped after step 2 (both agents write
    the one run directory, as nodes sharing a file system do); a copy of that run resumed on
    2 x 2 ranks through the ``sparse-dist`` pipeline for steps 3-4."""
    root = tmp_path_factory.mktemp("multinode")
    one, two, pipelined = root / "one", root / "two", root / "pipelined"

    def launch(out: Path, *extra: str) -> str:
        node = ["train", "--out", str(out), "--nnodes", "2", "--nproc-per-node", "2",
                "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-timeout", "120",
                "--sharding", "ddp", *RUN, *ROW_WISE_PER_NODE, *extra]
        results = _agents(node, node, timeout=600)
        for result in results:
            assert result.returncode == 0, result.stderr[-3000:]
        return "".join(r.stderr for r in results)

    log = launch(two, "--until-step", "2")
    shutil.copytree(two, pipelined)
    launch(pipelined, "--set", "parallel.embedding.pipeline=sparse-dist")
    single = gem("train", "--out", str(one), *RUN)
    assert single.returncode == 0, single.stderr[-3000:]
    return {"one": one, "two": two, "pipelined": pipelined, "log": log}


@pytest.mark.distributed
@pytest.mark.slow
def test_two_nodes_shard_tables_per_node_and_train_like_one_process(runs):
    summary = json.loads((runs["two"] / "summary.json").read_text())
    assert summary["run"]["world_size"] == 4 and summary["run"]["nodes"] == 2
    plan = summary["embedding_sharding"]["plan"]
    nodes = [{0, 1}, {2, 3}]
    for table in ("user_segment", "context"):
        info = plan[table]
        assert info["sharding_type"] == "table_row_wise"
        # Whole on one node, its rows split over both of that node's ranks.
        assert set(info["ranks"]) in nodes, info
        assert sorted(s["offsets"][0] for s in info["shards"]) == [0, info["shards"][0]["sizes"][0]]
    assert _losses(runs["two"]) == pytest.approx(_losses(runs["one"])[:2], rel=LOSS_RTOL)


@pytest.mark.distributed
@pytest.mark.slow
def test_two_node_checkpoint_resumes_in_one_process(gem, tmp_path, runs):
    out = tmp_path / "resumed"
    shutil.copytree(runs["two"], out)
    result = gem("train", "--out", str(out), "--sharding", "none", *RUN)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resharded from 4 to 1 ranks" in result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["resumed_from"] == 2 and summary["run"]["nodes"] == 1
    # Steps 3-4 need the tables and their row-wise Adagrad sums back from the 4 ranks' shards.
    assert _losses(out) == pytest.approx(_losses(runs["one"]), rel=LOSS_RTOL)


@pytest.mark.distributed
@pytest.mark.slow
def test_two_node_row_wise_tables_train_through_the_sparse_dist_pipeline(runs):
    """table_row_wise on gloo with batches of different sizes per rank: the pipeline's lookups,
    built a batch ahead, are padded like the plain forward's (unpadded, TorchRec's backward
    fails in gloo's all-gather). sparse-dist is exact: the losses are one process's."""
    summary = json.loads((runs["pipelined"] / "summary.json").read_text())
    assert summary["run"]["resumed_from"] == 2 and summary["run"]["world_size"] == 4
    pipeline = summary["embedding_sharding"]["pipeline"]
    assert pipeline["kind"] == "sparse-dist" and pipeline["pipelined_modules"] == ["ebc", "ec"]
    assert _losses(runs["pipelined"]) == pytest.approx(_losses(runs["one"]), rel=LOSS_RTOL)


def _failed_in_time(result, started: float, timeout_s: int) -> float:
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    # Start-up (imports of two agents, then their ranks) takes 10-30 s on an idle 2-core
    # machine and several times that under load (three training jobs beside the suite); the
    # point is that the configured timeout, not torchrun's default 600 s, ends the wait.
    assert elapsed < timeout_s + 240, elapsed
    return elapsed


@pytest.mark.distributed
def test_an_endpoint_that_never_answers_fails_within_the_timeout(gem, tmp_path):
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        endpoint = f"127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        result = gem("train", "--out", str(tmp_path / "run"), "--nnodes", "2",
                     "--rdzv-endpoint", endpoint, "--rdzv-timeout", "5", *RUN, timeout=300)
    _failed_in_time(result, started, 5)
    assert (f"the rendezvous endpoint {endpoint} did not answer within 5 s (--rdzv-timeout)"
            in result.stderr), result.stderr[-3000:]
    # The same words as when the serving agent of a run is going away: the fix is named too.
    assert (f"every node must run the same command with --nnodes 2 and --rdzv-endpoint "
            f"{endpoint}" in result.stderr), result.stderr[-3000:]


def _different_nnodes_outcome(stderr: str, endpoint: str, nnodes: int) -> str | None:
    """Which of the ways two agents told different --nnodes can end this agent's output
    shows, or None when it shows none of them (or an error that does not name the fix)."""
    if re.search(r"the agents were started with different --nnodes \(--nnodes 2 on "
                 r"node\(s\) \[\d\]; --nnodes 3 on node\(s\) \[\d\]\) and torchrun's "
                 r"rendezvous formed a group of 2 nodes", stderr):
        return "formed"  # the rendezvous took the first agent's count; its ranks refused
    same = (f"every node must run the same command with --nnodes {nnodes} and "
            f"--rdzv-endpoint {endpoint}")
    if same not in stderr:
        return None
    ways = {
        # waited for its count until the timeout
        "waited": f"the rendezvous at {endpoint} did not gather {nnodes} nodes within 5 s "
                  "(--rdzv-timeout)",
        # found the rendezvous closed by the other agent, which had given up
        "closed": f"the rendezvous at {endpoint} was closed by another node",
        # the agent serving the endpoint had already given up and exited (or was exiting
        # when this agent's probe reached it): nobody answers
        "unanswered": f"the rendezvous endpoint {endpoint} did not answer within 5 s "
                      "(--rdzv-timeout)",
    }
    return next((way for way, message in ways.items() if message in stderr), None)


@pytest.mark.distributed
def test_agents_with_different_nnodes_fail_with_a_clear_error(tmp_path):
    """Two agents, told 2 and 3 nodes. Depending on which joins first and when, torchrun's
    rendezvous forms a group of 2 (its count is the first agent's), whose ranks then refuse to
    train; or an agent waits for its count until --rdzv-timeout and closes the rendezvous on
    the other, or exits before the other reaches its endpoint at all. Which one happens is a
    race between the two processes; every way must end in an error that names --nnodes and
    the endpoint."""
    endpoint = f"127.0.0.1:{_free_port()}"
    common = ["train", "--out", str(tmp_path / "run"), "--rdzv-endpoint", endpoint,
              "--rdzv-timeout", "5", *RUN]
    started = time.monotonic()
    results = _agents([*common, "--nnodes", "2"], [*common, "--nnodes", "3"], timeout=300)
    for result, nnodes in zip(results, (2, 3)):
        _failed_in_time(result, started, 5)
        assert _different_nnodes_outcome(result.stderr, endpoint, nnodes), \
            result.stderr[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_every_way_two_agents_disagree_on_nnodes_is_recognised():
    """The outcomes of the race above, as the launcher words them (its own functions), are
    each accepted, and an error that does not name the fix is not."""
    from gem_core.cli.launch import Launch, rendezvous_failure

    endpoint = "127.0.0.1:29999"
    launch = Launch(nnodes=3, nproc_per_node=1, rdzv_endpoint=endpoint, rdzv_timeout_s=5)
    for seen, way in (("timeout", "waited"), ("closed", "closed"),
                      ("connection", "unanswered")):
        assert _different_nnodes_outcome(rendezvous_failure(launch, {seen}, 1), endpoint,
                                         3) == way
    assert _different_nnodes_outcome(rendezvous_failure(launch, set(), 1), endpoint, 3) is None
    assert _different_nnodes_outcome("the rendezvous endpoint 127.0.0.1:29999 did not answer "
                                     "within 5 s (--rdzv-timeout)", endpoint, 3) is None


@pytest.mark.parametrize("arguments, message", [
    (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "node001"], "'node001' is not HOST:PORT"),
    (["--rdzv-endpoint", "node001:29400"], "--rdzv-endpoint is for runs of several nodes"),
])
def test_launch_options_are_checked_before_anything_starts(tmp_path, arguments, message):
    from click.testing import CliRunner

    from gem_core.cli.main import cli

    result = CliRunner().invoke(cli, ["train", "--out", str(tmp_path / "run"), *arguments])
    assert result.exit_code == 2
    assert message in result.output
    assert not (tmp_path / "run").exists()


def test_node_layout_comes_from_the_launcher_and_must_be_even():
    from gem_core.distributed import ParallelContext, node_layout
    from gem_core.errors import GemConfigError

    node = {"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2"}
    assert node_layout(node, 4, 3) == (2, 1)
    assert node_layout({}, 4, 3) == (4, 0)  # no launcher variables: one node
    context = ParallelContext(rank=3, world_size=4, local_world_size=2, node_rank=1)
    assert (context.num_nodes, context.local_world_size, context.node_rank) == (2, 2, 1)
    assert ParallelContext(world_size=4).num_nodes == 1
    with pytest.raises(GemConfigError, match="the launch has 6 ranks on 2 nodes, but this node "
                                             r"\(node rank 0\) has 2 \(LOCAL_WORLD_SIZE\)"):
        node_layout({"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "2"}, 6, 0)
    with pytest.raises(GemConfigError, match="6 ranks do not make whole nodes of 4 ranks"):
        ParallelContext(world_size=6, local_world_size=4)


def test_multi_node_sharding_types_are_refused_with_the_reason():
    from gem_core.embedding import EmbeddingTableConfig
    from gem_core.errors import GemConfigError
    from gem_parallel.torchrec.plan import parse_options, planner_constraints

    pooled = EmbeddingTableConfig(name="t", num_embeddings=16, dim=8, features=("f",),
                                  pooling="sum")
    sequence = EmbeddingTableConfig(name="s", num_embeddings=16, dim=8, features=("g",),
                                    pooling="none")
    row_wise = parse_options({"plan": {"t": "table_row_wise"}})
    assert planner_constraints([pooled], row_wise, 4, "cpu", local_world_size=2)
    with pytest.raises(GemConfigError, match="table 't' cannot be table_row_wise on one node "
                                             r"\(4 rank\(s\)\): it splits a table's rows"):
        planner_constraints([pooled], row_wise, 4, "cpu")
    with pytest.raises(GemConfigError, match="table 't' cannot be grid_shard on cpu: TorchRec "
                                             "1.8's grid-sharded lookups over gloo"):
        planner_constraints([pooled], parse_options({"plan": {"t": "grid_shard"}}), 4, "cpu",
                            local_world_size=2)
    with pytest.raises(GemConfigError, match="table 's' cannot be table_row_wise: it is a "
                                             "sequence table"):
        planner_constraints([sequence], parse_options({"plan": {"s": "table_row_wise"}}), 4,
                            "cpu", local_world_size=2)


def test_hsdp_replicates_across_nodes_and_shards_within_a_node_by_default():
    """The mesh FullyShardedStrategy builds for rank 2 of 2 nodes x 2 ranks, on a fake group:
    its shard group is its node's ranks, its replica group one rank of each node."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from gem_core.distributed import ParallelContext
    from gem_parallel.fsdp import FullyShardedStrategy, HsdpOptions

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=2, world_size=4)
    try:
        hsdp = FullyShardedStrategy(hybrid=True)
        two_nodes = ParallelContext(rank=2, world_size=4, local_world_size=2, node_rank=1)
        mesh, _ = hsdp.mesh(two_nodes, HsdpOptions())
        assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard")
        assert mesh.mesh.tolist() == [[0, 1], [2, 3]]
        assert dist.get_process_group_ranks(mesh.get_group("dp_shard")) == [2, 3]
        assert dist.get_process_group_ranks(mesh.get_group("dp_replicate")) == [0, 2]
        # Explicit options still win; one node shards over every rank.
        mesh, _ = hsdp.mesh(two_nodes, HsdpOptions(dp_shard=4))
        assert mesh.mesh.tolist() == [[0, 1, 2, 3]]
        mesh, _ = hsdp.mesh(ParallelContext(rank=2, world_size=4), HsdpOptions())
        assert mesh.mesh.tolist() == [[0, 1, 2, 3]]
    finally:
        dist.destroy_process_group()
