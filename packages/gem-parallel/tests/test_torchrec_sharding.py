"""``torchrec`` embedding sharding on 2 CPU ranks over gloo against the unsharded model.

One torchrun launch (this file run as a script) checks every case and writes a JSON report; the
tests read it. Per case, with each rank holding a different number of samples of one global batch
(as the LPT balancer leaves them):

- the logits of the sharded model equal the unsharded reference model's on the same samples;
- the dense parameters' gradients (after DDP's all-reduce, or FSDP2's reduce-scatter, gathered)
  equal the reference's on the union of the ranks' samples with the global-mean loss;
- the tables after one fused SGD step (the update happens inside the backward, so this is how the
  embedding gradient shows) equal the reference's ``weight - lr * grad``;
- evaluation (gathered tables) gives the same again;
- the checkpoint state is every table as a ShardedTensor holding this rank's shards only (no
  gathered copy), under the replicated backend's names; written with DCP, perturbed and loaded
  back, the tables are as before.

Tolerance: float32 everywhere; only the order of sums differs (all-to-all pooling, all-reduce),
so everything agrees to 1e-5 absolute (measured: about 1e-7).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from gem_core.testing.processes import run_process_group

ATOL = 1e-5
LR = 0.5
# The synthetic source's tables plus "topic" (multi-valued event and candidate features, hash
# ids) that the request-level cases add. "item" is shared by an event and a candidate feature.
SEQUENCE = ("item", "action", "advertiser", "category", "topic")
POOLED = ("user_segment", "context")
TABLES = SEQUENCE + POOLED
PLAIN_TABLES = tuple(t for t in TABLES if t != "topic")
# (case name, forced plan, dense strategy, data). TorchRec offers row_wise for pooled tables on
# CUDA only (test_row_wise_pooled_table_is_refused_on_cpu), so the row-wise cases split the
# sequence tables by rows and the pooled tables by columns. Data "requests": K = 4 candidates
# per request from the synthetic source, cut to 1..4 per request (jagged), with a multi-valued
# feature; "plain": the synthetic source as it is (one candidate per request).
ROW_WISE = {**{t: "row_wise" for t in SEQUENCE}, **{t: "column_wise" for t in POOLED}}
CASES = [
    ("table_wise", {t: "table_wise" for t in TABLES}, "ddp", "requests"),
    ("row_wise", ROW_WISE, "ddp", "requests"),
    ("column_wise", {t: "column_wise" for t in TABLES}, "ddp", "requests"),
    ("row_wise_fsdp2", ROW_WISE, "fsdp2", "requests"),
    ("planner", {}, "ddp", "requests"),
    ("plain", {}, "ddp", "plain"),
]
OVERRIDES = ["data.max_seq_len=24", "model.num_layers=1", "model.window=8",
             "data.options.num_items=64", "model.embedding_dim=16"]


def with_topics(schema, batch, seed: int = 0):
    """``schema`` and ``batch`` with a ``topic`` table (hash ids) indexed by a multi-valued
    event feature (mean-pooled) and a multi-valued candidate feature (sum-pooled): 1 to 3 raw
    64-bit ids per event and per candidate."""
    import attrs
    import torch

    from gem_core.jagged import Jagged, offsets_from_lengths
    from gem_core.schema import EmbeddingTable, SequenceFeature

    generator = torch.Generator().manual_seed(seed)

    def topics(rows: int) -> Jagged:
        lengths = torch.randint(1, 4, (rows,), generator=generator)
        values = torch.randint(-2**62, 2**62, (int(lengths.sum()),), generator=generator)
        return Jagged(values, offsets_from_lengths(lengths))

    schema = attrs.evolve(
        schema,
        tables=(*schema.tables, EmbeddingTable(name="topic", num_embeddings=24,
                                               id_policy="hash")),
        event_features=(*schema.event_features,
                        SequenceFeature(name="topics", table="topic", multi_valued=True)),
        candidate_features=(*schema.candidate_features,
                            SequenceFeature(name="topics", table="topic", multi_valued=True,
                                            pooling="sum")))
    batch = attrs.evolve(batch,
                         event_ids={**batch.event_ids, "topics": topics(batch.num_events)},
                         candidate_ids={**batch.candidate_ids,
                                        "topics": topics(batch.num_candidates)})
    return schema, batch


def jagged_candidates(batch):
    """``batch`` with request ``r`` keeping its first ``1 + r % K`` candidates."""
    import attrs
    import torch

    from gem_core.batch import select_ids
    from gem_core.jagged import offsets_from_lengths

    counts = batch.candidate_counts()
    keep = torch.minimum(1 + torch.arange(batch.batch_size) % counts, counts)
    index = torch.cat([torch.arange(int(start), int(start) + int(k))
                       for start, k in zip(batch.candidate_offsets[:-1], keep)])
    return attrs.evolve(
        batch, candidate_offsets=offsets_from_lengths(keep),
        candidate_ids={k: select_ids(v, index) for k, v in batch.candidate_ids.items()},
        labels={k: v[index] for k, v in batch.labels.items()},
        candidate_dense=None if batch.candidate_dense is None else batch.candidate_dense[index])


def case_data(kind: str):
    """``(config, schema, batch)`` of a case's data: 12 requests."""
    from gem_core.config import load_config
    from gem_core.plugins import build_plugins

    if kind == "plain":
        config = load_config(preset="tiny", overrides=OVERRIDES)
        source = build_plugins().data_source(config.data, seed=0)
        return config, source.schema, source.generate(12, split=0, index=0)
    config = load_config(preset="tiny", overrides=[
        *OVERRIDES, "data.options.candidates_per_request=4"])
    source = build_plugins().data_source(config.data, seed=0)
    schema, batch = with_topics(source.schema, source.generate(12, split=0, index=0))
    batch = jagged_candidates(batch)
    batch.validate(schema)
    return config, schema, batch


# -- the worker (runs on every rank under torchrun) ---------------------------------------------

def _worker(out_path: str) -> None:
    import copy

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.tensor import DTensor

    from gem_core.attention.bucketed import BucketedAttention
    from gem_core.distributed import init_from_environment
    from gem_core.embedding import ReferenceEmbeddingBackend
    from gem_core.model import build_model
    from gem_core.precision import Float32Recipe
    from gem_parallel.ddp import DistributedDataParallelStrategy
    from gem_parallel.fsdp import FsdpOptions, FullyShardedStrategy
    from gem_parallel.torchrec.plan import TorchRecOptions
    from gem_parallel.torchrec.sharding import TorchRecSharding

    def loss_sum(model, logits, batch, tasks):
        """The tasks' losses (as gem_core.train.loss computes them) plus the model's own
        per-impression losses of this forward (as the trainer adds them), summed over the
        impressions: a loop of one's own that leaves the latter out trains a head that gets no
        gradient, which DDP refuses."""
        tasks_sum = sum(torch.nn.functional.binary_cross_entropy_with_logits(
            logits[t].float(), batch.labels[t], reduction="sum") for t in tasks)
        return tasks_sum + sum(model.impression_loss_sums().values())

    torch.set_num_threads(1)
    ctx = init_from_environment("cpu")
    report: dict = {}

    for name, forced, dense, data in CASES:
        config, schema, batch = case_data(data)
        tables_of_case = TABLES if data == "requests" else PLAIN_TABLES
        global_n = batch.batch_size
        # Uneven split: rank 0 gets 7 requests, rank 1 gets 5 (with their candidates).
        cut = 7
        mine = torch.arange(0, cut) if ctx.rank == 0 else torch.arange(cut, global_n)
        local = batch.select(mine)
        # The candidates (impressions) of this rank's requests, in the global batch's order.
        mine_candidates = torch.cat([torch.arange(int(batch.candidate_offsets[r]),
                                                  int(batch.candidate_offsets[r + 1]))
                                     for r in mine])
        impressions = batch.num_candidates
        tasks = schema.tasks
        torch.manual_seed(0)
        reference = build_model(config.model, schema, attention=BucketedAttention(),
                                embedding_backend=ReferenceEmbeddingBackend())
        model = copy.deepcopy(reference)
        # Reference: one process on the union of the ranks' samples, loss = global mean.
        ref_logits = reference(batch)
        loss_sum(reference, ref_logits, batch, tasks).div(impressions).backward()
        ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters()
                     if p.grad is not None}

        strategy = TorchRecSharding()
        options = TorchRecOptions(optimizer="sgd", lr=LR, plan=forced)
        model = strategy.apply(model, ctx=ctx, options=options)
        dense_strategy, dense_options = ((DistributedDataParallelStrategy(), None)
                                         if dense == "ddp" else
                                         (FullyShardedStrategy(hybrid=False), FsdpOptions()))
        engine = dense_strategy.apply(
            model, ctx=ctx, make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.0),
            precision=Float32Recipe(), options=dense_options)
        engine.train(True)
        logits = engine(local)
        loss = loss_sum(engine.unwrapped, logits, local, tasks) * (ctx.world_size / impressions)
        engine.backward(loss)

        case: dict = {"plan": strategy.plan, "data": data,
                      "candidates_per_request": batch.candidate_counts().tolist(),
                      "plan_features": {t: list(c.features) for t, c in
                                        engine.unwrapped.embeddings.table_configs.items()}}
        case["logits"] = max(float((logits[t] - ref_logits[t][mine_candidates]).abs().max())
                             for t in tasks)
        grad_err, compared = 0.0, 0
        for pname, param in engine.unwrapped.named_parameters():
            pname = pname.removeprefix("module.")
            grad = param.grad
            if isinstance(grad, DTensor):
                grad = grad.full_tensor()
            if grad is None:
                continue
            compared += 1
            grad_err = max(grad_err, float((grad - ref_grads[pname]).abs().max()))
        case["dense_grads"], case["dense_grads_compared"] = grad_err, compared
        case["dense_params_with_grads"] = len(ref_grads) - sum(
            1 for n in ref_grads if n.startswith("embeddings."))
        case["optimizer_params"] = sum(p.numel() for g in engine.optimizer.param_groups
                                       for p in g["params"])
        case["dense_params"] = sum(p.numel() for n, p in reference.named_parameters()
                                   if not n.startswith("embeddings."))
        case["table_params_seen"] = sum(1 for n, _ in engine.unwrapped.named_parameters()
                                        if n.startswith("embeddings."))
        sharded = engine.unwrapped.embeddings
        tables = sharded.full_tables()  # collective
        row_err = 0.0
        for t in tables_of_case:
            weight = reference.embeddings.tables[t].weight
            expected = weight.detach() - LR * weight.grad
            row_err = max(row_err, float((tables[t] - expected).abs().max()))
        case["tables_after_sgd"] = row_err
        # The step changed the tables (the comparison is not of untouched ones).
        case["tables_moved"] = min(
            float((tables[t] - reference.embeddings.tables[t].weight).abs().max())
            for t in tables_of_case)

        # Evaluation: gathered tables, no collective in the forward.
        engine.train(False)
        updated = copy.deepcopy(reference)
        with torch.no_grad():
            for t in tables_of_case:
                updated.embeddings.tables[t].weight.copy_(tables[t])
        updated.eval()
        eval_logits = engine.predict(local)
        expected_eval = updated(batch)
        case["eval_logits"] = max(float((eval_logits[t] - expected_eval[t][mine_candidates])
                                        .abs().max()) for t in tasks)
        engine.train(True)

        # Checkpoint state: this rank's shards of every table, through DCP and back after a
        # perturbation. The model's own state dict holds no table.
        case["tables_in_state_dict"] = [k for k in engine.unwrapped.state_dict()
                                        if k.startswith(("embeddings.", "module.embeddings."))]
        parts = sharded.sharded_checkpoint_state()
        case["state_keys"] = sorted(parts["model"])
        case["state_optimizer_keys"] = sorted(parts["optimizer"])  # SGD keeps no state
        state_err, local_values = 0.0, 0
        for key, weight in parts["model"].items():
            full = tables[key.split(".")[1]]
            for shard in weight.local_shards():
                (row, col), (rows, cols) = shard.metadata.shard_offsets, shard.tensor.shape
                local_values += shard.tensor.numel()
                state_err = max(state_err, float(
                    (shard.tensor - full[row:row + rows, col:col + cols]).abs().max()))
        case["state_tables"] = state_err
        case["state_local_share"] = local_values / sum(t.numel() for t in tables.values())
        checkpoint = Path(out_path).parent / f"checkpoint-{name}"
        dcp.save(parts, checkpoint_id=checkpoint)
        with torch.no_grad():
            for _, _, shard in sharded._local_shards():
                shard.add_(1.0)
        dcp.load(sharded.sharded_checkpoint_state(), checkpoint_id=checkpoint,
                 planner=DefaultLoadPlanner(flatten_sharded_tensors=False))
        reloaded = sharded.full_tables()
        case["state_roundtrip"] = max(float((reloaded[t] - tables[t]).abs().max())
                                      for t in tables_of_case)
        # Ids outside a table are refused before any collective, as the reference does.
        bad = copy.copy(local)
        object.__setattr__(bad, "candidate_ids",
                           {**local.candidate_ids, "item": local.candidate_ids["item"] + 1000})
        try:
            engine(bad)
            case["bad_ids"] = "accepted"
        except ValueError as error:
            case["bad_ids"] = str(error)
        report[name] = case
        dist.barrier()

    if ctx.rank == 0:
        Path(out_path).write_text(json.dumps(report, indent=1))
    dist.barrier()
    dist.destroy_process_group()


# -- the tests ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("torchrec") / "report.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--standalone", __file__, str(out)]
    result = run_process_group(command, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.mark.distributed
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_sharded_embeddings_match_reference(report, case):
    got = report[case]
    forced = dict((c[0], c[1]) for c in CASES)[case]
    plan = got["plan"]
    tables = TABLES if got["data"] == "requests" else PLAIN_TABLES
    assert sorted(plan) == sorted(tables)
    # One table shared by an event and a candidate feature (one EmbeddingCollection table with
    # both feature names); the multi-valued features go unpooled to theirs.
    assert got["plan_features"]["item"] == ["event.item", "candidate.item"]
    if got["data"] == "requests":
        assert got["plan_features"]["topic"] == ["event.topics", "candidate.topics"]
        # Jagged candidates: 1 to 4 per request, split unevenly over the ranks.
        assert sorted(set(got["candidates_per_request"])) == [1, 2, 3, 4]
    else:
        assert set(got["candidates_per_request"]) == {1}
    for table, kind in forced.items():
        assert plan[table]["sharding_type"] == kind
        if kind in ("row_wise", "column_wise"):
            # Really split: the table has a shard on both ranks.
            assert sorted({s["rank"] for s in plan[table]["shards"]}) == [0, 1], plan[table]
    assert got["logits"] <= ATOL
    assert got["dense_grads_compared"] == got["dense_params_with_grads"] > 0
    assert got["dense_grads"] <= ATOL
    assert got["tables_after_sgd"] <= ATOL
    assert got["tables_moved"] > 10 * ATOL
    assert got["eval_logits"] <= ATOL
    assert got["tables_in_state_dict"] == []
    assert got["state_keys"] == sorted(f"tables.{t}.weight" for t in tables)
    assert got["state_optimizer_keys"] == []
    assert got["state_tables"] == 0.0
    # Each rank holds its shards only: about half of all the values, never all of them.
    assert 0.0 < got["state_local_share"] < 1.0
    assert got["state_roundtrip"] == 0.0
    assert "embedding table 'item', feature 'candidate.item'" in got["bad_ids"]


@pytest.mark.distributed
def test_dense_optimizer_does_not_own_the_tables(report):
    for case in report.values():
        # The optimizer the dense strategy built holds the dense parameters and no table.
        assert case["optimizer_params"] == case["dense_params"]
        assert case["table_params_seen"] == 0


# -- one process: the options and what TorchRec cannot do on CPU ------------------------------

def _tiny_model():
    import torch

    from gem_core.attention.bucketed import BucketedAttention
    from gem_core.config import load_config
    from gem_core.embedding import ReferenceEmbeddingBackend
    from gem_core.model import build_model
    from gem_core.plugins import build_plugins

    config = load_config(preset="tiny", overrides=OVERRIDES)
    source = build_plugins().data_source(config.data, seed=0)
    torch.manual_seed(0)
    model = build_model(config.model, source.schema, attention=BucketedAttention(),
                        embedding_backend=ReferenceEmbeddingBackend())
    return model, source.generate(6, split=0, index=0)


@pytest.mark.parametrize("options, message", [
    ({"plan": {"nope": "table_wise"}}, "names table 'nope', which the model does not have"),
    ({"plan": {"item": "diagonal"}}, "table 'item': unknown sharding type 'diagonal'"),
    ({"plan": {"item": "data_parallel"}},
     "table 'item': sharding type 'data_parallel' is not offered"),
    # TorchRec 1.8's EmbeddingBagCollectionSharder offers row_wise on CUDA only.
    ({"plan": {"user_segment": "row_wise"}},
     "table 'user_segment' cannot be row_wise: it is pooled (TorchRec EmbeddingBagCollection) "
     "and TorchRec's sharder offers only table_wise, column_wise for those on cpu (row-wise "
     "pooling sums partial bags with a reduce-scatter"),
    ({"optimizer": "adam"}, "parallel.embedding.optimizer"),
    ({"lr": 0}, "parallel.embedding.lr"),
    ({"lr_schedule": "cosine"}, "parallel.embedding.lr_schedule"),
    ({"plans": {}}, "unknown key 'parallel.embedding.plans'"),
])
def test_bad_options_are_refused_with_the_reason(options, message):
    from gem_core.distributed import ParallelContext
    from gem_core.errors import GemConfigError
    from gem_parallel.torchrec.plan import parse_options
    from gem_parallel.torchrec.sharding import TorchRecSharding

    model, _ = _tiny_model()
    with pytest.raises(GemConfigError) as error:
        TorchRecSharding().apply(model, ctx=ParallelContext(), options=parse_options(options))
    assert message in str(error.value)


def test_dense_lr_schedule_reaches_the_fused_update():
    """With ``lr_schedule = "dense"`` the factor the trainer passes scales the learning rate the
    fused SGD update of the backward uses: factor 0 leaves the tables as they were, factor 1
    moves them; ``constant`` ignores the factor."""
    import torch

    from gem_core.distributed import ParallelContext, shutdown
    from gem_parallel.torchrec.plan import TorchRecOptions
    from gem_parallel.torchrec.sharding import TorchRecSharding
    from gem_parallel.torchrec.state import table_weights

    def tables(model):
        return {name: weight.local_shards()[0].tensor.detach().clone() for name, weight in
                table_weights(model.embeddings._sharded).items()}

    ctx = ParallelContext()
    try:
        for schedule, factor, moves in (("dense", 0.0, False), ("dense", 1.0, True),
                                        ("constant", 0.0, True)):
            model, batch = _tiny_model()
            TorchRecSharding().apply(model, ctx=ctx, options=TorchRecOptions(
                optimizer="sgd", lr=0.5, lr_schedule=schedule))
            assert model.embeddings.follow_learning_rate(factor) == (
                0.5 * factor if schedule == "dense" else 0.5)
            before = tables(model)
            sum(logits.sum() for logits in model(batch).values()).backward()
            changed = [name for name, weight in tables(model).items()
                       if not torch.equal(weight, before[name])]
            assert bool(changed) == moves, (schedule, factor, changed)
    finally:
        shutdown(ctx)  # the one-rank group the strategy started


def test_column_wise_needs_a_width_that_splits_over_the_ranks():
    from gem_core.embedding import EmbeddingTableConfig
    from gem_core.errors import GemConfigError
    from gem_parallel.torchrec.plan import parse_options, planner_constraints

    table = EmbeddingTableConfig(name="t", num_embeddings=10, dim=16, features=("f",))
    with pytest.raises(GemConfigError, match="table 't' is column_wise but its width 16 does "
                                             "not split evenly over 3 ranks"):
        planner_constraints([table], parse_options({"plan": {"t": "column_wise"}}), 3, "cpu")


def _layout(plan: dict[str, tuple[str, int]], optimizer: str = "rowwise_adagrad") -> dict:
    from gem_parallel.torchrec.state import layout

    described = {t: {"sharding_type": kind,
                     "shards": [{"offsets": [0, c * 8], "sizes": [10, 8]} for c in range(n)]}
                 for t, (kind, n) in plan.items()}
    return layout(described, optimizer)


def test_resume_keeps_row_wise_adagrad_state_only_where_rows_stay_whole():
    from gem_core.errors import GemConfigError
    from gem_parallel.torchrec.state import check_resume

    saved = _layout({"item": ("row_wise", 1), "context": ("column_wise", 2)})
    # Another number of row shards, or table-wise instead of row-wise: one sum per row either way.
    check_resume(saved, _layout({"item": ("table_wise", 1), "context": ("column_wise", 2)}))
    with pytest.raises(GemConfigError, match="table 'context': row-wise Adagrad keeps one sum per "
                                             "row of each column shard; the checkpoint's plan cut "
                                             "it into 2 column shard.*this run's into 1"):
        check_resume(saved, _layout({"item": ("row_wise", 1), "context": ("table_wise", 1)}))
    with pytest.raises(GemConfigError, match=r"resume with --set parallel.embedding.plan.item="
                                             r"row_wise, or use --fresh"):
        check_resume(saved, _layout({"item": ("column_wise", 4), "context": ("column_wise", 2)}))
    with pytest.raises(GemConfigError, match="parallel.embedding.optimizer is 'sgd'"):
        check_resume(saved, _layout({"item": ("row_wise", 1), "context": ("column_wise", 2)},
                                    "sgd"))
    # SGD keeps no state: any layout continues.
    check_resume(_layout({"context": ("column_wise", 2)}, "sgd"),
                 _layout({"context": ("table_wise", 1)}, "sgd"))


if __name__ == "__main__":
    _worker(sys.argv[1])
