"""``train.tables_each_pass = "reinitialize"`` (MEDA): the feature tables draw their rows anew
before the first step of each pass after the first, their optimizer state zeroed, the dense
layers untouched; a run stopped at the end of a pass (its checkpoint holds the trained tables)
and resumed trains the same steps as one run straight through; layouts whose tables the trainer
cannot redraw, and data without passes, are refused at start-up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gem_core.embedding import ReferenceEmbeddingCollection
from gem_core.embedding_tables import EmbeddingTableConfig
from gem_core.errors import GemConfigError
from gem_core.train.table_reset import reinitialize_tables, table_parameters

# 128 training requests in batches of 32: a pass is 4 steps, train.epochs = 2 is 8 steps.
TRAIN = ("train.steps=100", "train.epochs=2", "train.batch_size=32", "train.lr=0.01",
         "train.warmup_steps=1", "train.eval_every=4", "train.checkpoint_every=2",
         "data.max_seq_len=16", "model.interaction_dims=[16]", "data.eval_rows=64",
         "train.eval_batch_size=64", "data.source=parquet", "data.options={}",
         "train.tables_each_pass=reinitialize")


def _collection() -> ReferenceEmbeddingCollection:
    tables = [EmbeddingTableConfig(name=name, num_embeddings=rows, dim=4, features=(name,))
              for name, rows in (("ad", 50), ("category", 7))]
    return ReferenceEmbeddingCollection(tables, init_std=0.05)


def test_reinitialize_draws_the_initial_distribution_and_zeroes_the_optimizer_state():
    from gem_core.train.table_optimizer import AdamWWithTables, id_bias_group

    torch.manual_seed(0)
    tables = _collection()
    weights = table_parameters(tables)
    offsets = torch.nn.Parameter(torch.zeros(50, 2))  # model.id_bias's, with their own state
    optimizer = AdamWWithTables([{"params": weights},
                                 id_bias_group([offsets], 0.25, "fisher", "learned")], lr=0.1)
    for weight in (*weights, offsets):
        weight.grad = torch.randn_like(weight)
    optimizer.step()
    trained = [w.detach().clone() for w in weights]
    assert offsets.any() and optimizer.state[offsets]["fisher"].any()
    prior = optimizer.state[offsets]["prior"].clone()
    assert not torch.allclose(prior, torch.full((2,), 0.25))

    reinitialize_tables(tables, optimizer, seed=3, passes=1, offsets=[offsets])
    assert not offsets.any()
    assert set(optimizer.state[offsets]) == {"step", "fisher", "prior"}
    assert not optimizer.state[offsets]["step"] and not optimizer.state[offsets]["fisher"].any()
    # the learned prior says how much the ids' effects vary: a new pass keeps it
    assert torch.equal(optimizer.state[offsets]["prior"], prior)
    drawn = [w.detach().clone() for w in weights]
    for before, after in zip(trained, drawn):
        assert not torch.equal(before, after)
    everything = torch.cat([w.flatten() for w in drawn]).double()
    assert everything.mean().abs() < 0.01 and abs(everything.std().item() - 0.05) < 0.005
    for weight in weights:
        state = optimizer.state[weight]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}  # the keys stay, zeroed
        assert all(not value.any() for value in state.values())

    # The same seed and pass draw the same rows (every rank, a resumed run); another pass not.
    again = _collection()
    reinitialize_tables(again, torch.optim.AdamW(table_parameters(again)), seed=3, passes=1)
    assert all(torch.equal(a, b) for a, b in zip(drawn, table_parameters(again)))
    reinitialize_tables(again, torch.optim.AdamW(table_parameters(again)), seed=3, passes=2)
    assert not any(torch.equal(a, b) for a, b in zip(drawn, table_parameters(again)))


@pytest.fixture(scope="module")
def data(small_data_set) -> Path:
    return small_data_set


def _train(data: Path, out: Path, *extra: str, until_step: int | None = None) -> dict:
    from gem_core.config import load_config
    from gem_core.plugins import build_plugins
    from gem_core.train.trainer import train

    config = load_config(preset="tiny", overrides=[*TRAIN, f"data.path={data}", *extra])
    return train(config, build_plugins(), out, progress=False, until_step=until_step).summary


def _losses(run: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in map(json.loads, (
        run / "metrics.jsonl").read_text().splitlines()) if "loss" in row}


def _eval_ne(summary: dict) -> dict[str, float]:
    return {task: figures["ne"] for task, figures in summary["eval_last"].items()}


def test_each_later_pass_starts_with_fresh_tables_and_a_resumed_run_does_the_same(
        data, tmp_path, caplog):
    with caplog.at_level("INFO", logger="gem_core.train.trainer"):
        straight = _train(data, tmp_path / "straight")
    assert straight["run"]["steps"] == 8 and straight["run"]["data_passes"] == 2
    said = [r.getMessage() for r in caplog.records if "tables_each_pass" in r.getMessage()]
    assert len(said) == 1 and "start pass 2" in said[0] and "(step 4)" in said[0], said
    losses = _losses(tmp_path / "straight")
    # Against the same run keeping its tables: the same first pass, then other steps from the
    # first step of pass 2 on (its forward reads the fresh rows).
    _train(data, tmp_path / "kept", "train.tables_each_pass=keep")
    kept = _losses(tmp_path / "kept")
    # (threads sum in their own order: runs agree to float32 rounding, not bit for bit)
    assert [losses[s] for s in range(1, 5)] == pytest.approx([kept[s] for s in range(1, 5)],
                                                             rel=1e-6)
    assert abs(losses[5] - kept[5]) > 1e-3, (losses, kept)

    # Stopped at the end of pass 1 (the checkpoint holds the trained tables) and at a step
    # inside pass 2 (after the reset): resumed, each trains the same steps as the run above.
    for stop in (4, 6):
        run = tmp_path / f"stopped-{stop}"
        _train(data, run, until_step=stop)
        resumed = _train(data, run)
        assert _losses(run) == pytest.approx(losses, rel=1e-6, abs=1e-7), stop
        assert _eval_ne(resumed) == pytest.approx(_eval_ne(straight), rel=1e-5), stop


def test_the_tables_of_a_one_pass_run_are_never_redrawn(data, tmp_path, caplog):
    with caplog.at_level("INFO", logger="gem_core.train.trainer"):
        summary = _train(data, tmp_path / "run", "train.epochs=1")
    assert summary["run"]["steps"] == 4
    assert not [r for r in caplog.records if "tables_each_pass" in r.getMessage()]


@pytest.mark.parametrize("extra, refusal", [
    (("data.source=synthetic", "data.path="), "needs data whose passes the trainer counts"),
    (("backends.embedding=reference-fused",), "trains its tables inside the backward"),
])
def test_what_cannot_redraw_the_tables_is_refused_before_training(data, tmp_path, extra,
                                                                   refusal):
    with pytest.raises(GemConfigError, match=refusal):
        _train(data, tmp_path / "run", *extra)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_row_is_drawn_alike_whichever_part_of_its_table_a_rank_holds(monkeypatch):
    """A rank holding some rows of a table (FSDP2's dim-0 shard) draws for them what one
    process draws for the whole table, across block boundaries and at the table's end."""
    from gem_core.train import table_reset

    monkeypatch.setattr(table_reset, "DRAW_BLOCK_ROWS", 8)
    kwargs = dict(std=0.05, seed=3, passes=1, table=1, device=torch.device("cpu"),
                  dtype=torch.float32)
    whole = table_reset.draw_rows(range(0, 29), (29, 4), **kwargs)
    parts = [table_reset.draw_rows(rows, (29, 4), **kwargs)
             for rows in (range(0, 5), range(5, 5), range(5, 17), range(17, 29))]
    assert torch.equal(torch.cat(parts), whole)
    # blocks are streams of their own: no two blocks repeat each other, nor two tables
    assert not torch.equal(whole[:8], whole[8:16])
    other = table_reset.draw_rows(range(0, 29), (29, 4), **{**kwargs, "table": 0})
    assert not torch.equal(other, whole)


def test_dim_0_shards_are_drawn_in_place_and_columns_split_are_refused(tmp_path):
    """A table held as a DTensor: dim-0 shards (FSDP2, HSDP) draw their own rows, the values
    one process draws; a table split by columns cannot be drawn by rows and is refused."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from gem_core.train.table_reset import check_tables_drawable

    whole = _collection()
    reinitialize_tables(whole, torch.optim.AdamW(table_parameters(whole)), seed=5, passes=2)
    tables = _collection()
    check_tables_drawable(tables, "ddp")  # whole tables: nothing to refuse
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for table in tables.tables.values():
            table.weight = torch.nn.Parameter(distribute_tensor(table.weight.detach(), mesh,
                                                                [Shard(0)]))
        check_tables_drawable(tables, "fsdp2")
        optimizer = torch.optim.AdamW(table_parameters(tables))
        reinitialize_tables(tables, optimizer, seed=5, passes=2)
        for a, b in zip(table_parameters(whole), table_parameters(tables)):
            assert torch.equal(a, b.full_tensor())
        table = tables.tables["ad"]
        by_columns = distribute_tensor(table.weight.full_tensor().detach(), mesh, [Shard(1)])
        table.weight = torch.nn.Parameter(by_columns)
        with pytest.raises(GemConfigError, match="'tp' splits feature table 'ad'.s columns"):
            check_tables_drawable(tables, "tp")
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_fsdp2_ranks_redraw_their_shards_as_one_process_draws_the_tables(data, tmp_path, gem):
    """Two FSDP2 ranks (each holding half of every table's rows) over two passes, stopped
    inside the second pass and resumed, train the steps of one process: the fresh rows of
    pass 2 are the same values on any layout."""
    sets = [arg for setting in (*TRAIN, f"data.path={data}") for arg in ("--set", setting)]
    single = _train(data, tmp_path / "single")
    assert single["run"]["data_passes"] == 2
    out = tmp_path / "fsdp2"
    command = ["train", "--preset", "tiny", "--out", str(out), "--nproc-per-node", "2",
               "--sharding", "fsdp2", "--no-progress", *sets]
    stopped = gem(*command, "--until-step", "6")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    resumed = gem(*command)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    losses, reference = _losses(out), _losses(tmp_path / "single")
    assert sorted(losses) == sorted(reference) == list(range(1, 9))
    # reduce-scatter sums in another order than one backward: float32 rounding, no more
    assert losses == pytest.approx(reference, rel=1e-5)
    assert _eval_ne(json.loads((out / "summary.json").read_text())) == pytest.approx(
        _eval_ne(single), rel=1e-4)
