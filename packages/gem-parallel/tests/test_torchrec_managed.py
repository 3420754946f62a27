"""``id_policy = "managed"``: TorchRec's managed-collision remapper in front of a table.

In one process: distinct hot ids that ``hash`` puts in one row get rows of their own; a full
table evicts by its policy (LRU: the id seen longest ago; LFU: the one seen the fewest times) and
evaluation inserts nothing; a batch larger than the first still inserts all its ids; bad options,
a backend without the capability and several ranks without ``torchrec`` are refused at start-up.

On 2 CPU ranks (gloo, one torchrun launch of this file as a script), under ``--embedding-sharding
torchrec`` with the managed table ``row_wise``: ranks that look up different ids keep identical
remappers, equal to one process's remapper fed both ranks' ids in rank order, and every rank's
rows and vectors are that process's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from gem_core.schema import EmbeddingTable, FeatureSchema, SequenceFeature

ROWS = 16


def managed(rows: int = ROWS, **options) -> EmbeddingTable:
    return EmbeddingTable(name="ad", num_embeddings=rows, id_policy="managed", **options)


def colliding_pair(rows: int = ROWS) -> tuple[int, int]:
    """Two 64-bit ids the ``hash`` policy puts in one row of a ``rows``-row table."""
    from gem_core.ids import map_ids

    table = EmbeddingTable(name="ad", num_embeddings=rows, id_policy="hash")
    ids = torch.arange(2**62, 2**62 + 64)
    hashed = map_ids(ids, table)
    for i in range(64):
        same = (hashed == hashed[i]).nonzero().flatten()
        if same.numel() > 1:
            return int(ids[same[0]]), int(ids[same[1]])
    raise AssertionError("no colliding pair among 64 ids in 16 rows")


def _collection(table: EmbeddingTable):
    from gem_core.embedding import EmbeddingTableConfig
    from gem_parallel.torchrec.managed import ManagedEmbeddingBackend

    torch.manual_seed(0)
    config = EmbeddingTableConfig(name="ad", num_embeddings=table.num_embeddings, dim=4,
                                  pooling="none", features=("event.ad_id", "candidate.ad_id"),
                                  managed=table)
    return ManagedEmbeddingBackend().build([config])


def test_managed_keeps_hot_ids_apart_where_hash_collides():
    from gem_core.ids import map_ids
    from gem_core.jagged import Jagged

    a, b = colliding_pair()
    hashed = map_ids(torch.tensor([a, b]), EmbeddingTable(name="ad", num_embeddings=ROWS,
                                                          id_policy="hash"))
    assert hashed[0] == hashed[1]
    collection = _collection(managed()).train()
    events = torch.tensor([a, b, a, b, a])
    candidates = torch.tensor([b, a])
    out = collection({"event.ad_id": Jagged(events, torch.tensor([0, 3, 5])),
                      "candidate.ad_id": Jagged(candidates, torch.tensor([0, 1, 2]))})
    remapper = collection.remappers["ad"]
    rows = remapper.eval()(torch.tensor([a, b]))
    assert rows[0] != rows[1] and set(rows.tolist()) <= set(range(ROWS - 1))
    # One map for both features of the shared table; the vectors are exactly those rows'.
    weight = collection.tables["ad"].weight
    row_of = {a: int(rows[0]), b: int(rows[1])}
    assert torch.equal(out["event.ad_id"], weight[torch.tensor([row_of[int(i)] for i in events])])
    assert torch.equal(out["candidate.ad_id"],
                       weight[torch.tensor([row_of[int(i)] for i in candidates])])
    assert not torch.equal(weight[rows[0]], weight[rows[1]])


@pytest.mark.parametrize("policy, evicted", [("lru", 3), ("lfu", 2)])
def test_a_full_table_evicts_by_its_policy_and_evaluation_inserts_nothing(policy, evicted):
    from gem_parallel.torchrec.managed import IdRemapper

    # 4 rows: 3 live ids and the shared row. 3 is seen first (three times), 2 once, 1 twice.
    remapper = IdRemapper(managed(4, eviction_policy=policy)).train()
    for batch in ([3, 3, 3], [2], [1, 1]):
        remapper(torch.tensor(batch))
    before = {i: int(remapper.eval()(torch.tensor([i]))) for i in (1, 2, 3)}
    assert sorted(before.values()) == [0, 1, 2]
    # LRU drops 3 (seen longest ago); LFU drops 2 (seen once); 4 takes the freed row.
    remapper.train()(torch.tensor([4, 4]))
    assert remapper.live_ids().tolist() == sorted({1, 2, 3, 4} - {evicted})
    assert int(remapper.eval()(torch.tensor([4]))) == before[evicted]
    state = {k: v.clone() for k, v in remapper.state_dict().items()}
    rows = remapper(torch.tensor([5, evicted, 4]))  # evaluation: unseen ids get the shared row
    assert rows.tolist() == [3, 3, before[evicted]]
    assert all(torch.equal(state[k], v) for k, v in remapper.state_dict().items())


def test_a_batch_larger_than_the_first_inserts_every_id():
    from gem_parallel.torchrec.managed import IdRemapper

    remapper = IdRemapper(managed()).train()
    remapper(torch.tensor([1]))
    rows = remapper(torch.arange(100, 110))  # TorchRec alone would record only the first id
    assert len(set(rows.tolist())) == 10 and ROWS - 1 not in rows.tolist()


def test_loading_a_state_into_a_used_remapper_continues_from_that_state():
    from gem_parallel.torchrec.managed import IdRemapper

    used, fresh = (IdRemapper(managed(4)).train() for _ in range(2))
    used(torch.tensor([1, 2]))
    saved = {k: v.clone() for k, v in used.state_dict().items()}
    for batch in ([3], [4, 5], [6]):  # a rollback: these steps are undone below
        used(torch.tensor(batch))
    used.load_state_dict(saved)
    fresh.load_state_dict(saved)
    for batch in ([3, 1], [7], [2, 8]):
        assert torch.equal(used(torch.tensor(batch)), fresh(torch.tensor(batch)))
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in used.state_dict().items())


def test_bad_options_and_ids_are_refused():
    from gem_core.schema import schema_from_dict, schema_to_dict
    from gem_parallel.torchrec.managed import IdRemapper

    with pytest.raises(ValueError, match="eviction_policy"):
        managed(eviction_policy="fifo")
    with pytest.raises(ValueError, match="'ad': eviction_policy applies to id_policy 'managed'"):
        EmbeddingTable(name="ad", num_embeddings=8, id_policy="hash", eviction_policy="lfu")
    with pytest.raises(ValueError, match="eviction_decay weighs the counts of eviction_policy "
                                         "'distance_lfu'"):
        managed(eviction_decay=2.0)
    with pytest.raises(ValueError, match="at least 2 rows"):
        managed(1)
    assert managed(eviction_policy="distance_lfu", eviction_decay=0.5).eviction_decay == 0.5
    schema = FeatureSchema(tables=(managed(eviction_policy="lfu"),
                                   EmbeddingTable(name="cat", num_embeddings=4)),
                           event_features=(SequenceFeature(name="ad_id", table="ad"),),
                           candidate_features=(SequenceFeature(name="cat", table="cat"),))
    data = schema_to_dict(schema)
    # Other tables read as before the policy existed (run and data-set schemas still compare).
    assert "eviction_policy" not in data["tables"][1]
    assert schema_from_dict(data) == schema
    data["tables"][0]["eviction_policy"] = "random"
    with pytest.raises(ValueError, match=r"schema: tables\[0\]: .*eviction_policy"):
        schema_from_dict(data)
    with pytest.raises(ValueError, match="9223372036854775807"):
        IdRemapper(managed())(torch.tensor([7, 2**63 - 1]))


def test_start_up_names_the_table_and_the_backends_that_handle_it():
    from gem_core.embedding import EmbeddingTableConfig, ReferenceEmbeddingCollection
    from gem_core.errors import GemConfigError
    from gem_core.ids import check_managed_ids
    from gem_core.plugins import build_plugins

    plugins = build_plugins()
    schema = FeatureSchema(tables=(managed(),), event_features=(SequenceFeature(
        name="ad_id", table="ad"),), candidate_features=(SequenceFeature(name="ad_id",
                                                                         table="ad"),))
    spec = {kind: {s.name: s for s in plugins.registry(kind).specs()}
            for kind in ("embedding", "embedding_sharding")}
    with pytest.raises(GemConfigError, match="'ad' have id_policy 'managed', which the embedding "
                                             "backend 'reference' does not handle.*"
                                             "torchrec-managed"):
        check_managed_ids(schema, embedding=spec["embedding"]["reference"],
                          embedding_sharding=spec["embedding_sharding"]["replicated"],
                          world_size=1, plugins=plugins)
    check_managed_ids(schema, embedding=spec["embedding"]["torchrec-managed"],
                      embedding_sharding=spec["embedding_sharding"]["replicated"], world_size=1,
                      plugins=plugins)
    with pytest.raises(GemConfigError, match="2 ranks.*'replicated'.*--embedding-sharding "
                                             "torchrec"):
        check_managed_ids(schema, embedding=spec["embedding"]["torchrec-managed"],
                          embedding_sharding=spec["embedding_sharding"]["replicated"],
                          world_size=2, plugins=plugins)
    with pytest.raises(ValueError, match="ad have id_policy 'managed'.*torchrec-managed"):
        ReferenceEmbeddingCollection([EmbeddingTableConfig(
            name="ad", num_embeddings=ROWS, dim=4, pooling="none", features=("x",),
            managed=managed())])


def test_collision_report_of_a_managed_table():
    import numpy as np

    from gem_core.ids import collision_report

    report = collision_report(np.array([5, 9, 9, 2**62, -3] + list(range(100, 120))), managed())
    assert report == {"distinct_ids": 24, "rows_used": 15, "colliding_ids": 0,
                      "collision_rate": 0.0, "over_capacity_ids": 9}


# -- 2 ranks under the torchrec embedding sharding (runs on every rank under torchrun) ----------

RANK_IDS = {0: [[11, 12, 13, 11], [14, 11, 15]], 1: [[21, 12, 22], [23, 24, 25, 26, 21]]}
"""Per rank, the ids of each training lookup (12 and 11/21 shared or repeated); 8 live rows."""


def _worker(out_path: str) -> None:
    import copy

    import torch.distributed as dist

    from gem_core.distributed import init_from_environment
    from gem_core.jagged import Jagged
    from gem_parallel.torchrec.plan import TorchRecOptions
    from gem_parallel.torchrec.sharding import TorchRecSharding

    torch.set_num_threads(1)
    ctx = init_from_environment("cpu")
    table = managed(9)
    single = _collection(table).train()  # one process fed both ranks' ids in rank order

    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embeddings = copy.deepcopy(single)

    model = TorchRecSharding().apply(Holder(), ctx=ctx, options=TorchRecOptions(
        plan={"ad": "row_wise"}, optimizer="sgd"))
    sharded = model.embeddings
    report: dict = {"plan": sharded.plan["ad"]["sharding_type"], "rows": [], "vectors_equal": []}
    for step in range(2):
        # Each rank: its event ids, and its first id again as a candidate (the shared table's
        # features are remapped together: events then candidates, rank after rank).
        ids = torch.tensor(RANK_IDS[ctx.rank][step])
        both = torch.tensor([i for r in (0, 1) for i in RANK_IDS[r][step] + RANK_IDS[r][step][:1]])
        expected = single({"event.ad_id": Jagged(both, torch.tensor([0, both.numel()])),
                           "candidate.ad_id": Jagged(both[:0], torch.tensor([0, 0]))})
        out = sharded({"event.ad_id": Jagged(ids, torch.tensor([0, ids.numel()])),
                       "candidate.ad_id": Jagged(ids[:1], torch.tensor([0, 1]))})
        start = 0 if ctx.rank == 0 else len(RANK_IDS[0][step]) + 1
        mine = expected["event.ad_id"][start:start + ids.numel()]
        report["vectors_equal"].append(bool(torch.equal(out["event.ad_id"], mine)))
    # Every rank's remapper state, and the single process's.
    state = {k: v.tolist() for k, v in sharded.remappers["ad"].state_dict().items()}
    states: list = [None] * ctx.world_size
    dist.all_gather_object(states, state)
    report["states_equal"] = all(s == states[0] for s in states)
    report["equals_single_process"] = states[0] == {
        k: v.tolist() for k, v in single.remappers["ad"].state_dict().items()}
    report["live"] = sharded.remappers["ad"].live_ids().tolist()
    model.embeddings.train(False)  # collective: gathers the tables
    unseen = sharded({"event.ad_id": Jagged(torch.tensor([99, 11]), torch.tensor([0, 2])),
                      "candidate.ad_id": Jagged(torch.tensor([99]), torch.tensor([0, 1]))})
    report["eval_unseen_is_shared_row"] = bool(torch.equal(
        unseen["candidate.ad_id"][0], single.tables["ad"].weight[8]))
    report["eval_inserted_nothing"] = sharded.remappers["ad"].live_ids().tolist() == \
        report["live"]
    if ctx.rank == 0:
        Path(out_path).write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.distributed
def test_two_ranks_remap_alike_under_torchrec_row_wise(tmp_path):
    from gem_core.testing.processes import run_process_group

    out = tmp_path / "report.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--standalone", __file__, str(out)]
    result = run_process_group(command, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-5000:]
    report = json.loads(out.read_text())
    assert report["plan"] == "row_wise"
    assert report["vectors_equal"] == [True, True]
    assert report["states_equal"] and report["equals_single_process"]
    # 15 distinct ids for 8 live rows: the second lookup evicted some of the first's.
    assert len(report["live"]) == 8
    assert report["eval_unseen_is_shared_row"] and report["eval_inserted_nothing"]


if __name__ == "__main__":
    _worker(sys.argv[1])
