"""Row-wise Adagrad and SGD for tables that are parameters, in the dense optimizer step
(``[model.embedding_optimizer] dense_tables = "same"``, :mod:`gem_core.train.table_optimizer`):
against a float64 loop written here, against ``torch.optim.AdamW`` for the other groups, and
end to end against ``reference-fused`` (the same update applied inside the backward)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from torch import nn

from gem_core.config import TrainConfig, load_config
from gem_core.config.model_schema import EmbeddingOptimizerConfig
from gem_core.engine import Engine
from gem_core.errors import GemConfigError
from gem_core.plugins import build_plugins
from gem_core.train.optim import make_optimizer
from gem_core.train.table_optimizer import AdamWWithTables, resolve_table_optimizer

SAME = dict(dense_tables="same")


class _Model(nn.Module):
    """Feature tables under ``embeddings`` (one bag, one plain), another embedding beside them
    (like the age buckets), a dense layer."""

    def __init__(self, *, sparse: bool = False) -> None:
        super().__init__()
        self.embeddings = nn.ModuleDict({
            "bag": nn.EmbeddingBag(12, 4, mode="sum", sparse=sparse),
            "plain": nn.Embedding(7, 4, sparse=sparse)})
        self.age = nn.Embedding(5, 4)
        self.linear = nn.Linear(4, 1)

    def forward(self, bags: torch.Tensor, offsets: torch.Tensor, ids: torch.Tensor,
                ages: torch.Tensor) -> torch.Tensor:
        pooled = self.embeddings["bag"](bags, offsets)
        return self.linear(pooled + self.embeddings["plain"](ids) + self.age(ages)).sum()


def _model(seed: int = 0, **kwargs) -> _Model:
    torch.manual_seed(seed)
    return _Model(**kwargs).double()


def _batch(step: int) -> tuple[torch.Tensor, ...]:
    """Ids with duplicates within a bag and rows no batch looks up (bag rows 10, 11; plain 6);
    never all zero gradients (the weights are random)."""
    g = torch.Generator().manual_seed(100 + step)
    bags = torch.randint(0, 10, (9,), generator=g)
    bags[1] = bags[0]
    offsets = torch.tensor([0, 3, 5])
    ids = torch.randint(0, 6, (3,), generator=g)
    ages = torch.randint(0, 5, (3,), generator=g)
    return bags, offsets, ids, ages


def _oracle_step(weight: torch.Tensor, momentum: torch.Tensor, grad: torch.Tensor, *, lr: float,
                 options: EmbeddingOptimizerConfig) -> None:
    """Row by row, in float64: FBGEMM's exact row-wise Adagrad / SGD on the rows whose gradient
    is not all zeros."""
    for r in range(weight.shape[0]):
        g = grad[r].clone()
        if not g.ne(0).any():
            continue
        if options.name == "sgd":
            weight[r] -= lr * g
            continue
        if options.weight_decay and options.weight_decay_mode == "l2":
            g += options.weight_decay * weight[r]
        momentum[r] += float((g * g).mean())
        step = lr * g / (math.sqrt(momentum[r]) + options.eps)
        if options.weight_decay and options.weight_decay_mode == "decoupled":
            weight[r] = (1 - lr * options.weight_decay) * weight[r] - step
        else:
            weight[r] -= step


@pytest.mark.parametrize("options", [
    EmbeddingOptimizerConfig(lr=0.1, **SAME),
    EmbeddingOptimizerConfig(lr=0.1, weight_decay=0.3, weight_decay_mode="l2", **SAME),
    EmbeddingOptimizerConfig(lr=0.1, weight_decay=0.3, weight_decay_mode="decoupled", **SAME),
    EmbeddingOptimizerConfig(name="sgd", lr=0.1, **SAME),
    EmbeddingOptimizerConfig(lr=0.05, lr_schedule="dense", **SAME),
], ids=["adagrad", "l2", "decoupled", "sgd", "dense-schedule"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense-grad", "sparse-grad"])
def test_tables_step_row_wise_and_the_rest_is_adamw(options, sparse):
    train = TrainConfig(lr=0.01, weight_decay=0.1, embedding_lr_scale=3.0)
    model, twin = _model(sparse=sparse), _model(sparse=sparse)
    optimizer = make_optimizer(train, options, feature_tables=model.embeddings)(model)
    assert isinstance(optimizer, AdamWWithTables)
    # The twin: plain AdamW for everything but the feature tables, the loop above for them.
    adamw = torch.optim.AdamW([
        {"params": [twin.linear.weight], "weight_decay": 0.1},
        {"params": [twin.linear.bias], "weight_decay": 0.0},
        {"params": [twin.age.weight], "weight_decay": 0.0, "lr_scale": 3.0}],
        lr=0.01, betas=(0.9, 0.98), eps=1e-8)
    tables = {"bag": twin.embeddings["bag"].weight, "plain": twin.embeddings["plain"].weight}
    momenta = {name: torch.zeros(t.shape[0], dtype=torch.float64) for name, t in tables.items()}
    engine, twin_engine = Engine(model, optimizer), Engine(twin, adamw)
    untouched = {name: t.detach().clone() for name, t in tables.items()}
    for step in range(4):
        schedule = 0.01 * (1.0 - 0.2 * step)  # a decaying dense rate
        engine.set_lr(schedule)
        twin_engine.set_lr(schedule)
        model(*_batch(step)).backward()
        twin(*_batch(step)).backward()
        engine.step()
        lr = options.lr * (schedule / 0.01 if options.lr_schedule == "dense" else 1.0)
        with torch.no_grad():
            for name, weight in tables.items():
                grad = weight.grad.to_dense() if weight.grad.is_sparse else weight.grad
                _oracle_step(weight, momenta[name], grad, lr=lr, options=options)
                weight.grad = None
        adamw.step()
        adamw.zero_grad(set_to_none=True)
    for name, weight in tables.items():
        torch.testing.assert_close(model.embeddings[name].weight, weight, rtol=0, atol=1e-12)
        state = optimizer.state[model.embeddings[name].weight]
        assert state["step"] == 4
        if options.name == "sgd":
            assert set(state) == {"step"}
        else:
            torch.testing.assert_close(state["momentum1"], momenta[name], rtol=0, atol=1e-12)
    # Rows no batch looked up are as they were, their momentum zero.
    assert torch.equal(model.embeddings["bag"].weight[10:], untouched["bag"][10:])
    assert torch.equal(model.embeddings["plain"].weight[6:], untouched["plain"][6:])
    if options.name != "sgd":
        assert optimizer.state[model.embeddings["bag"].weight]["momentum1"][10:].eq(0).all()
    for mine, theirs in ((model.linear.weight, twin.linear.weight),
                         (model.linear.bias, twin.linear.bias),
                         (model.age.weight, twin.age.weight)):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-12)
        assert set(optimizer.state[mine]) == {"step", "exp_avg", "exp_avg_sq"}


def test_without_row_wise_tables_the_groups_are_adamws():
    model = _model()
    optimizer = make_optimizer(TrainConfig(embedding_lr_scale=5.0))(model)
    assert not any(g.get("table_optimizer") for g in optimizer.param_groups)
    with pytest.raises(ValueError, match="feature tables"):
        make_optimizer(TrainConfig(), EmbeddingOptimizerConfig(**SAME))


def test_a_zero_gradient_step_at_zero_rate_changes_nothing():
    """What DCP does to create an optimizer's state before loading into it: every gradient zero,
    every group's lr 0, one step. With weight decay too, the tables and their state stay."""
    options = EmbeddingOptimizerConfig(lr=0.1, weight_decay=0.5, **SAME)
    model = _model()
    optimizer = make_optimizer(TrainConfig(), options, feature_tables=model.embeddings)(model)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert optimizer.state[model.embeddings["bag"].weight]["momentum1"].eq(0).all()


def test_the_state_round_trips_through_a_state_dict():
    options = EmbeddingOptimizerConfig(lr=0.1, **SAME)
    model = _model()
    optimizer = make_optimizer(TrainConfig(), options, feature_tables=model.embeddings)(model)
    for step in range(2):
        model(*_batch(step)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved = copy.deepcopy(optimizer.state_dict())  # the live tensors would move on below
    restored = _model(seed=5)
    restored.load_state_dict(saved_model)
    again = make_optimizer(TrainConfig(), options, feature_tables=restored.embeddings)(restored)
    again.load_state_dict(saved)
    for m, o in ((model, optimizer), (restored, again)):
        m(*_batch(7)).backward()
        o.step()
    for key, value in model.state_dict().items():
        assert torch.equal(restored.state_dict()[key], value), key


# -- start-up checks -------------------------------------------------------------------------------

def _spec(kind: str, name: str):
    return build_plugins().registry(kind).get(name)


def test_start_up_decides_auto_and_refuses_same_where_the_rows_cannot_be_stepped(caplog):
    plugins = build_plugins()
    embedding, replicated = _spec("embedding", "reference"), _spec("embedding_sharding",
                                                                   "replicated")

    def resolve(dense_tables, dense="ddp", tables=replicated, backend=embedding):
        options = EmbeddingOptimizerConfig(lr=0.1, dense_tables=dense_tables)
        return resolve_table_optimizer(options, embedding=backend, embedding_sharding=tables,
                                       dense_sharding=_spec("dense_sharding", dense),
                                       plugins=plugins).dense_tables

    for name in ("none", "ddp", "fsdp2", "hsdp", "ep"):
        assert resolve("same", name) == "same"
        with caplog.at_level("INFO", logger="gem_core.train.table_optimizer"):
            assert resolve("auto", name) == "same"
        assert "dense_tables = auto: same: the feature tables train with rowwise_adagrad" in \
            caplog.text
    assert resolve("adamw") == "adamw"
    with pytest.raises(GemConfigError, match="'deepspeed-zero1' does not declare") as refused:
        resolve("same", "deepspeed-zero1")
    assert "ddp, ep, fsdp2, hsdp, none" in str(refused.value)
    caplog.clear()
    with caplog.at_level("INFO", logger="gem_core.train.table_optimizer"):
        assert resolve("auto", "deepspeed-zero3") == "adamw"
    assert "auto: adamw, because the dense sharding 'deepspeed-zero3'" in caplog.text
    torchrec = _spec("embedding_sharding", "torchrec")
    with pytest.raises(GemConfigError, match="'torchrec' replaces the tables"):
        resolve("same", tables=torchrec)
    assert resolve("auto", tables=torchrec) == "adamw"
    # A fused backend steps its own tables; dense_tables has nothing to add or refuse.
    fused = _spec("embedding", "reference-fused")
    assert resolve("same", "deepspeed-zero1", torchrec, fused) == "same"


def test_the_section_on_a_backend_without_the_fused_optimizer_needs_dense_tables_same():
    from gem_core.embedding import check_fused_optimizer

    def check(**fields):
        config = load_config(preset="tiny", overrides=[
            f"model.embedding_optimizer.{k}={json.dumps(v)}" for k, v in fields.items()])
        check_fused_optimizer(config.model, embedding=_spec("embedding", "reference"),
                              embedding_sharding=_spec("embedding_sharding", "replicated"),
                              world_size=2)

    with pytest.raises(GemConfigError, match="dense_tables = 'same'"):
        check(lr=0.1)
    check(lr=0.1, dense_tables="same")  # on 2 ranks: the dense step is after the all-reduce
    check(lr=0.1, dense_tables="auto")
    with pytest.raises(ValueError, match="dense_tables"):
        check(dense_tables="rows")


# -- end to end ------------------------------------------------------------------------------------

RUN = ["train.steps=4", "train.checkpoint_every=2", "train.batch_size=16", "data.eval_rows=32",
       "train.eval_batch_size=32", "train.warmup_steps=1", "train.eval_every=0",
       "data.max_seq_len=8", "model.interaction_dims=[16]", "model.num_layers=1",
       "train.deterministic=true", "model.embedding_optimizer.lr=0.1",
       # The fused backend's tables are outside the gradient norm; here they are inside it.
       "train.grad_clip=0"]


def _losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "loss" in r]


def test_a_run_equals_the_fused_backend_and_resumes_exactly(tmp_path):
    from gem_core.checkpoint.checkpointer import read_checkpoint
    from gem_core.train.trainer import train

    plugins = build_plugins()
    dense = load_config(preset="tiny", overrides=[
        *RUN, "model.embedding_optimizer.dense_tables=same"])
    fused = load_config(preset="tiny", overrides=[*RUN, "backends.embedding=reference-fused"])
    train(dense, plugins, tmp_path / "dense", progress=False)
    train(fused, plugins, tmp_path / "fused", progress=False)
    assert _losses(tmp_path / "dense") == pytest.approx(_losses(tmp_path / "fused"), rel=1e-6)
    last = "checkpoints/step-00000004"
    mine = read_checkpoint(tmp_path / "dense" / last)["engine"]
    theirs = read_checkpoint(tmp_path / "fused" / last)["engine"]
    tables = [k for k in theirs["model"] if k.startswith("embeddings.tables.")]
    assert tables
    # Same names, same values: weights and the per-row state. The two sum a row's gradient in
    # different orders (autograd's embedding backward against the fused backward's index_add),
    # and row-wise Adagrad turns a float32 relative error of a rarely-seen row's gradient into
    # about lr x that error in the row: 1.3e-6 measured on one element of 64,000 with one
    # thread, under 1e-6 with two; 1e-5 leaves room for other thread counts.
    for key in tables:
        torch.testing.assert_close(mine["model"][key], theirs["model"][key], rtol=0, atol=1e-5)
        torch.testing.assert_close(mine["optimizer"]["state"][key]["momentum1"],
                                   theirs["optimizer"]["state"][key]["momentum1"],
                                   rtol=1e-5, atol=1e-9)
    # Stopped at step 2 and resumed: the same trajectory, bit for bit.
    train(dense, plugins, tmp_path / "parts", progress=False, until_step=2)
    resumed = train(dense, plugins, tmp_path / "parts", progress=False)
    assert resumed.summary["run"]["resumed_from"] == 2
    assert _losses(tmp_path / "parts") == _losses(tmp_path / "dense")
    final = read_checkpoint(tmp_path / "parts" / last)["engine"]
    for key in tables:
        assert torch.equal(final["model"][key], mine["model"][key]), key
