"""``gem_core.train.optim.make_optimizer``: which parameters decay, and the embedding tables' own
learning-rate scale (``train.embedding_lr_scale``) through the engine's ``set_lr``."""

import pytest
from torch import nn

from gem_core.config import TrainConfig
from gem_core.engine import Engine
from gem_core.train.optim import make_optimizer


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(10, 4)
        self.bag = nn.EmbeddingBag(10, 4)
        self.norm = nn.LayerNorm(4)
        self.linear = nn.Linear(4, 4)


def _groups(optimizer):
    return [{id(p) for p in g["params"]} for g in optimizer.param_groups]


def test_at_scale_one_the_groups_are_those_of_before():
    model = _Model()
    optimizer = make_optimizer(TrainConfig(weight_decay=0.1))(model)
    decay, no_decay = _groups(optimizer)
    assert decay == {id(model.linear.weight)}
    assert no_decay == {id(p) for p in (model.table.weight, model.bag.weight, model.norm.weight,
                                        model.norm.bias, model.linear.bias)}
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]


def test_embedding_tables_follow_the_schedule_times_their_scale():
    model = _Model()
    optimizer = make_optimizer(TrainConfig(lr=0.002, embedding_lr_scale=5.0))(model)
    decay, no_decay, embeddings = _groups(optimizer)
    assert embeddings == {id(model.table.weight), id(model.bag.weight)}
    assert id(model.norm.weight) in no_decay and id(model.linear.weight) in decay
    assert optimizer.param_groups[2]["weight_decay"] == 0.0
    engine = Engine(model, optimizer)
    engine.set_lr(0.001)  # the schedule's value at some step
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.001, 0.001, 0.005])


def test_the_scale_must_be_positive():
    with pytest.raises(ValueError):
        TrainConfig(embedding_lr_scale=0.0)


@pytest.mark.parametrize("dense_tables", ["adamw", "auto"])
def test_a_run_whose_tables_train_under_adamw_says_nothing_about_the_scale(tmp_path, caplog,
                                                                           dense_tables):
    """The start-up warning of :mod:`gem_core.train.assembly` is for runs whose tables have an
    optimizer of their own (tested with ``fbgemm-tbe`` in gem-kernels, and below with
    ``dense_tables = "same"``): the reference tables under AdamW take the scale, and with
    ``auto`` the start-up log has already said what they train with."""
    from gem_core.config import load_config
    from gem_core.plugins import build_plugins
    from gem_core.train.trainer import train

    config = load_config(preset="tiny", overrides=[
        "train.steps=1", "train.batch_size=8", "data.eval_rows=16", "train.eval_every=0",
        "train.checkpoint_every=0", "data.max_seq_len=8", "model.interaction_dims=[16]",
        "model.num_layers=1", f"model.embedding_optimizer.dense_tables={dense_tables}"])
    assert config.train.embedding_lr_scale != 1.0
    with caplog.at_level("WARNING", logger="gem_core.train.assembly"):
        train(config, build_plugins(), tmp_path / "run", progress=False)
    assert "applies to none of this run's feature tables" not in caplog.text


def test_a_run_whose_tables_train_row_wise_says_the_scale_misses_them(tmp_path, caplog):
    from gem_core.config import load_config
    from gem_core.plugins import build_plugins
    from gem_core.train.trainer import train

    config = load_config(preset="tiny", overrides=[
        "train.steps=1", "train.batch_size=8", "data.eval_rows=16", "train.eval_every=0",
        "train.checkpoint_every=0", "data.max_seq_len=8", "model.interaction_dims=[16]",
        "model.num_layers=1", "model.embedding_optimizer.dense_tables=same",
        "model.embedding_optimizer.lr=0.1"])
    with caplog.at_level("WARNING", logger="gem_core.train.assembly"):
        train(config, build_plugins(), tmp_path / "run", progress=False)
    assert "embedding_lr_scale = 5 applies to none of this run's feature tables" in caplog.text
    assert "dense_tables = 'same' steps them with rowwise_adagrad at lr 0.1" in caplog.text
