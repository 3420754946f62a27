"""Third-party parts that implement only the documented contracts: a model refused by every
strategy when it lacks the model interface; a model and a dense strategy registered in-process
that train, checkpoint, resume and are planned end to end."""

from __future__ import annotations

import pytest
from torch import nn

from gem_core.distributed import ParallelContext
from gem_core.errors import GemConfigError


class PlainModel(nn.Module):
    """A model without the strategy interface (it has no ``tower.blocks`` either)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)


def _refusals():
    from gem_parallel.checkpointing import FullCheckpointing, SelectiveCheckpointing
    from gem_parallel.expert_parallel import ExpertParallelStrategy
    from gem_parallel.fsdp import FullyShardedStrategy
    from gem_precision.activation_stash import ActivationStash, install_stash

    ctx = ParallelContext()
    return {
        "parallel_units": lambda m: FullyShardedStrategy(hybrid=False).apply(
            m, ctx=ctx, make_optimizer=None, precision=None, options={}),
        "checkpoint_parts": lambda m: FullCheckpointing().apply(m, ctx=ctx, options={}),
        "checkpoint_parts ": lambda m: SelectiveCheckpointing().apply(
            m, ctx=ctx, options={"modules": ["mlp"]}),
        "moe_layers": lambda m: ExpertParallelStrategy().apply(
            m, ctx=ctx, make_optimizer=None, precision=None, options={}),
        "stash_points": lambda m: install_stash(m, ActivationStash(), ["linear"]),
    }


@pytest.mark.parametrize("method", ["parallel_units", "checkpoint_parts", "checkpoint_parts ",
                                    "moe_layers", "stash_points"])
def test_a_model_without_the_interface_is_refused_by_name(method):
    """Before the interface, FSDP2 silently made such a model one unit."""
    with pytest.raises(GemConfigError) as raised:
        _refusals()[method](PlainModel())
    message = str(raised.value)
    assert f"PlainModel.{method.strip()}()" in message and "StrategyModel" in message


def test_the_gem_model_answers_the_interface(tiny_gem_model):
    from gem_core.model.interface import CHECKPOINT_KINDS, STASH_KINDS

    model = tiny_gem_model
    units = model.parallel_units()
    assert units and all(unit in set(model.modules()) for unit in units)
    for kind in CHECKPOINT_KINDS:
        parts = model.checkpoint_parts(kind)
        assert parts and all(callable(getattr(owner, name)) for owner, name in parts)
    assert len(model.checkpoint_parts("block")) == 2 * len(units)  # blocks + cross layers
    with pytest.raises(ValueError, match="unknown kind 'everything'"):
        model.checkpoint_parts("everything")
    points = model.stash_points()
    assert set(points) == set(STASH_KINDS) and points["sequence_block"] == units
    assert model.moe_layers() == []


@pytest.fixture(scope="module")
def tiny_gem_model():
    from gem_core.testing.models import small_model, synthetic_batch

    schema, _ = synthetic_batch(2, max_seq_len=8)
    return small_model(schema, num_layers=2, cross_attention=True)
