"""The 2D sparse layout's options, groups and plan figures, in this process (the 4-rank run is
``tests/test_train_torchrec_2d.py``)."""

from __future__ import annotations

import pytest

from gem_core.errors import GemConfigError
from gem_core.plan_estimate import PlanFacts, TableFacts
from gem_parallel.torchrec.plan import parse_options
from gem_parallel.torchrec.two_d import SparseLayout, resolve


@pytest.mark.parametrize("options, world, message", [
    ({"layout": "2d"}, 4, "parallel.embedding.layout '2d' needs "
                          "parallel.embedding.sharding_group_size"),
    ({"sharding_group_size": 2}, 4, "parallel.embedding.sharding_group_size = 2 applies to "
                                    "layout '2d'; this run's parallel.embedding.layout is "
                                    "'model_parallel'"),
    ({"layout": "2d", "sharding_group_size": 3}, 4,
     "parallel.embedding.sharding_group_size 3 does not divide this run's 4 rank(s) into whole "
     "sharding groups; choose one of 1, 2, 4"),
    ({"layout": "2d", "sharding_group_size": 2}, 1,
     "does not divide this run's 1 rank(s) into whole sharding groups; choose one of 1 (1 on "
     "one process: every table whole on the one rank)"),
    ({"layout": "2d", "sharding_group_size": 2, "plan": {"context": "table_row_wise"}}, 4,
     "parallel.embedding.plan names 'table_row_wise', which layout '2d' does not offer"),
])
def test_bad_layouts_are_refused_with_the_reason(options, world, message):
    with pytest.raises(GemConfigError) as error:
        resolve(parse_options(options), world)
    assert message in str(error.value)


@pytest.mark.parametrize("options, message", [
    ({"layout": "3d"}, "parallel.embedding.layout"),
    ({"layout": "2d", "sharding_group_size": 0}, "parallel.embedding.sharding_group_size"),
    ({"layout": "2d", "sharding_group_size": 2, "sync_every": 0}, "parallel.embedding.sync_every"),
])
def test_bad_option_values_are_refused(options, message):
    with pytest.raises(GemConfigError, match=message):
        parse_options(options)


def test_groups_are_strided_as_torchrec_lays_them_out():
    # DMPCollection's docstring: 8 ranks in groups of 4 are [0, 2, 4, 6] and [1, 3, 5, 7].
    layout = SparseLayout(world_size=8, group_size=4)
    assert layout.groups == 2
    assert layout.group_ranks() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # What the plan gave its rank 1 is held by rank 2 in group 0 and by rank 3 in group 1.
    assert [layout.global_rank(1, rank) for rank in range(8)] == [2, 3] * 4
    assert resolve(parse_options({}), 8) is None
    assert resolve(parse_options({"layout": "2d", "sharding_group_size": 8}), 8).groups == 1


def _facts(world: int) -> PlanFacts:
    tables = (TableFacts(name="item", num_embeddings=1000, dim=16, pooled=False,
                         vectors_per_request=12.0),
              TableFacts(name="context", num_embeddings=10, dim=16, pooled=True,
                         vectors_per_request=1.0))
    return PlanFacts(world_size=world, dense_parameters=100, tables=tables, requests=8.0,
                     tokens=80.0, activations_per_token=1.0, activations_per_request=1.0)


def test_plan_estimate_of_two_groups_is_one_group_plus_the_replicas_average():
    from gem_parallel.torchrec.sharding import TorchRecSharding

    strategy = TorchRecSharding()
    two_d = {"layout": "2d", "sharding_group_size": 2}
    one_group = strategy.plan_estimate(_facts(2), parse_options({}))
    layout = strategy.plan_estimate(_facts(8), parse_options(two_d))
    # Memory and lookups: those of one group of 2 ranks, not of 8.
    for row in ("embedding_params", "embedding_optimizer"):
        assert layout.memory[row].bytes == one_group.memory[row].bytes > 0
    assert layout.communication["embedding"] == one_group.communication["embedding"]
    assert layout.tables == one_group.tables
    # Weights and row-wise Adagrad's sums per rank, all-reduced over 4 replicas per step.
    held = (1010 * 16 * 4 + 1010 * 4) / 2
    assert layout.details["sparse_layout"]["sync_bytes_per_rank"] == held
    assert layout.communication["embedding_sync"] == pytest.approx(2 * 3 / 4 * held)
    rarely = strategy.plan_estimate(_facts(8), parse_options({**two_d, "sync_every": 4,
                                                             "sync_optimizer_state": False}))
    assert rarely.communication["embedding_sync"] == pytest.approx(
        2 * 3 / 4 * 1010 * 16 * 4 / 2 / 4)
    with pytest.raises(GemConfigError, match="does not divide this run's 6 rank"):
        strategy.plan_estimate(_facts(6), parse_options({"layout": "2d",
                                                         "sharding_group_size": 4}))


def test_gem_plan_prints_the_2d_layout():
    from click.testing import CliRunner

    from gem_parallel.plan_cli import plan_command

    result = CliRunner().invoke(plan_command, [
        "--preset", "tiny", "--gpus", "4", "--gpu-memory", "1", "--sharding", "ddp",
        "--sharding-group-size", "2", "--set", "train.batch_size=16"])
    assert result.exit_code == 0, result.output
    assert "2D sparse layout: 2 sharding group(s) of 2 ranks; each rank averages" in result.output
    assert "embedding sync" in result.output


@pytest.mark.parametrize("every, averaged_before", [(1, [2, 3, 4, 5, 6, 7]), (3, [4, 7])])
def test_replicas_are_averaged_after_every_sync_every_steps(every, averaged_before):
    from gem_parallel.torchrec.two_d import SyncSchedule

    schedule = SyncSchedule(every=every)
    assert not schedule.pending  # nothing to average before the first step
    due = [step for step in range(1, 8) if schedule.step_starts()]
    assert due == averaged_before
    # Step 7 ran since: a checkpoint or evaluation averages first, and then nothing is pending.
    assert schedule.pending
    schedule.synced()
    assert not schedule.pending and not schedule.step_starts()
