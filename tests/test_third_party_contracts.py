"""Third-party parts that implement only the documented contracts: a model refused by every
strategy when it lacks the model interface; a model and a dense strategy registered in-process
that train, checkpoint, resume and are planned end to end."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gem_core.distributed import ParallelContext
from gem_core.errors import GemConfigError


class PlainModel(nn.Module):
    """A model without the strategy interface (it has no ``tower.blocks`` either)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)


def _refusals():
    from gem_parallel.checkpointing import (
        FullCheckpointing,
        SelectiveCheckpointing,
        SelectiveOptions,
    )
    from gem_parallel.expert_parallel import EpOptions, ExpertParallelStrategy
    from gem_parallel.fsdp import FsdpOptions, FullyShardedStrategy
    from gem_precision.activation_stash import ActivationStash, install_stash
    from gem_precision.selection import fp8_candidates

    ctx = ParallelContext()
    ranks = ParallelContext(world_size=2)  # refused before any process group is needed
    return {
        "parallel_units": lambda m: FullyShardedStrategy(hybrid=False).apply(
            m, ctx=ranks, make_optimizer=None, precision=None, options=FsdpOptions()),
        "checkpoint_parts": lambda m: FullCheckpointing().apply(m, ctx=ctx, options=None),
        "checkpoint_parts ": lambda m: SelectiveCheckpointing().apply(
            m, ctx=ctx, options=SelectiveOptions(modules=("mlp",))),
        "moe_layers": lambda m: ExpertParallelStrategy().apply(
            m, ctx=ctx, make_optimizer=None, precision=None, options=EpOptions()),
        "stash_points": lambda m: install_stash(m, ActivationStash(), ["linear"]),
        "output_heads": lambda m: fp8_candidates(m, exclude=(), min_dim=16),
    }


@pytest.mark.parametrize("method", ["parallel_units", "checkpoint_parts", "checkpoint_parts ",
                                    "moe_layers", "stash_points", "output_heads"])
def test_a_model_without_the_interface_is_refused_by_name(method):
    """Before the interface, FSDP2 silently made such a model one unit."""
    with pytest.raises(GemConfigError) as raised:
        _refusals()[method](PlainModel())
    message = str(raised.value)
    assert f"PlainModel.{method.strip()}()" in message and "StrategyModel" in message


def test_the_gem_model_answers_the_interface(tiny_gem_model):
    from gem_core.contracts import CHECKPOINT_KINDS, STASH_KINDS

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
    assert model.output_heads() == list(model.heads.values())


@pytest.fixture(scope="module")
def tiny_gem_model():
    from gem_core.testing.models import small_model, synthetic_batch

    schema, _ = synthetic_batch(2, max_seq_len=8)
    return small_model(schema, num_layers=2, cross_attention=True)


# ---------------------------------------------------------------------------------------------
# A third-party plugin, registered in-process, that uses only the documented contracts.
# ---------------------------------------------------------------------------------------------


class _ResidualMlp(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def _third_party_model_class():
    from gem_core.contracts import RankingModel, StrategyModel, check_checkpoint_kind
    from gem_core.model import embedding_tables
    from gem_core.model.features import FeatureLookup

    class MeanHistoryModel(nn.Module, RankingModel, StrategyModel):
        """Each request's mean event vector through residual MLP blocks, next to the candidate
        vector, into one linear head per task."""

        def __init__(self, config, schema, *, attention, embedding_backend, norm) -> None:
            super().__init__()
            dim = config.embedding_dim
            self.embeddings = embedding_backend.build(embedding_tables(config, schema))
            self.lookup = FeatureLookup(schema)
            self.blocks = nn.ModuleList(_ResidualMlp(dim) for _ in range(2))
            self.heads = nn.ModuleDict({t: nn.Linear(2 * dim, 1) for t in schema.tasks})

        def forward(self, batch):
            looked = self.lookup(self.embeddings, batch)
            requests = batch.batch_size
            lengths = batch.seq_lengths()
            rows = torch.repeat_interleave(torch.arange(requests), lengths)
            history = looked.events.new_zeros(requests, looked.events.shape[1]).index_add_(
                0, rows, looked.events) / lengths.clamp(min=1).unsqueeze(1)
            # Every table takes part: a parameter that never gets a gradient has no optimizer
            # state, which the checkpointer's resume expects (see the report of #20).
            history = history + sum(looked.context)
            for block in self.blocks:
                history = block(history)
            counts = batch.candidate_offsets[1:] - batch.candidate_offsets[:-1]
            owner = torch.repeat_interleave(torch.arange(requests), counts)
            shared = torch.cat([looked.candidates, history[owner]], dim=1)
            return {task: head(shared).squeeze(-1) for task, head in self.heads.items()}

        def flops(self, lengths, candidates=None):
            dim = self.heads[next(iter(self.heads))].in_features // 2
            requests = lengths.numel()
            impressions = requests if candidates is None else int(candidates.sum())
            total = 3 * 2 * (len(self.blocks) * 4 * dim * dim * requests
                             + len(self.heads) * 2 * dim * impressions)
            return {"total": total, "attention": 0, "padded_total": total,
                    "padded_attention": 0}

        def parallel_units(self):
            return list(self.blocks)

        def checkpoint_parts(self, kind):
            check_checkpoint_kind(kind)
            if kind == "block":
                return [(self.blocks, str(i)) for i in range(len(self.blocks))]
            if kind == "mlp":
                return [(block, "mlp") for block in self.blocks]
            return []

        def moe_layers(self):
            return []

        def output_heads(self):
            return list(self.heads.values())

        def stash_points(self):
            return {"linear": [m for m in self.modules() if isinstance(m, nn.Linear)],
                    "norm": [block.norm for block in self.blocks]}

    return MeanHistoryModel


def _third_party_plugin():
    """The plugin object: a model ``mean-history`` and a dense strategy ``unit-count``."""
    import types

    from gem_core import hookimpl
    from gem_core.contracts import DenseSharding, require_strategy_model
    from gem_core.engine import Engine
    from gem_core.plan_estimate import Estimate, adam_memory
    from gem_core.registry import ImplementationSpec

    class UnitCountEngine(Engine):
        def __init__(self, model, optimizer, units: int) -> None:
            super().__init__(model, optimizer)
            self.units = units

        def summary(self):
            return {"parallel_units": self.units}

    class UnitCountStrategy(DenseSharding):
        """One process; reports how many parallel units the model offers."""

        def apply(self, model, *, ctx, make_optimizer, precision, options):
            if options or ctx.world_size != 1:
                raise GemConfigError("unit-count takes no options and runs one process")
            units = require_strategy_model(model, "unit-count", "parallel_units")
            return UnitCountEngine(model, make_optimizer(model), len(units.parallel_units()))

        def plan_estimate(self, facts, options):
            return Estimate(memory=adam_memory("dense", facts.dense_parameters),
                            communication={"dense": 0},
                            details={"unit_count": {"ranks": facts.world_size}})

    class SilentStrategy(UnitCountStrategy):
        """The same strategy without an estimate (the contract's default)."""

        plan_estimate = DenseSharding.plan_estimate

    model_class = _third_party_model_class()

    def register_models(register):
        register(ImplementationSpec(name="mean-history", load=lambda: model_class,
                                    description="mean history + MLP blocks (third party)"))

    def register_dense(register):
        register(ImplementationSpec(name="unit-count", load=UnitCountStrategy))
        register(ImplementationSpec(name="silent", load=SilentStrategy))

    return types.SimpleNamespace(gem_register_models=hookimpl(register_models),
                                 gem_register_dense_sharding=hookimpl(register_dense))


THIRD_PARTY_RUN = ("backends.model=mean-history", "backends.dense_sharding=unit-count",
                   "backends.embedding_sharding=replicated", "train.steps=6",
                   "train.batch_size=16", "train.warmup_steps=1", "train.eval_every=0",
                   "train.checkpoint_every=3", "data.eval_rows=64", "train.eval_batch_size=64",
                   "data.max_seq_len=16", "train.deterministic=true")


@pytest.fixture(scope="module")
def third_party():
    from gem_core.config import load_config
    from gem_core.plugins import build_plugins

    plugins = build_plugins(extra_plugins=[("third_party", _third_party_plugin())])
    return load_config(preset="tiny", overrides=THIRD_PARTY_RUN), plugins


def test_a_third_party_model_and_strategy_train_checkpoint_resume_and_plan(third_party,
                                                                           tmp_path):
    import json

    from gem_core.attention.reference import ReferenceAttention
    from gem_core.checkpoint.checkpointer import read_checkpoint
    from gem_core.embedding import ReferenceEmbeddingBackend
    from gem_core.plugins import build_plugins
    from gem_core.train.trainer import train
    from gem_parallel.plan import Layout, plan

    config, plugins = third_party
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(config, plugins, whole, progress=False)
    train(config, plugins, parts, progress=False, until_step=3)
    train(config, plugins, parts, progress=False)
    summary = json.loads((parts / "summary.json").read_text())
    assert summary["backends"]["model"]["name"] == "mean-history"
    assert summary["backends"]["dense_sharding"]["name"] == "unit-count"
    assert summary["dense_sharding"] == {"parallel_units": 2}
    assert summary["run"]["resumed_from"] == 3 and summary["run"]["finished"]
    a = read_checkpoint(whole / "checkpoints" / "step-00000006")["engine"]["model"]
    b = read_checkpoint(parts / "checkpoints" / "step-00000006")["engine"]["model"]
    assert a.keys() == b.keys() and any(k.startswith("blocks.1.") for k in a)
    for key in a:  # resumed equals uninterrupted, bit for bit
        assert torch.equal(a[key], b[key]), key
    def losses(run):
        return [json.loads(line)["loss"]
                for line in (run / "metrics.jsonl").read_text().splitlines()]

    assert len(losses(whole)) == 6 and all(loss > 0 for loss in losses(whole))
    assert losses(parts) == losses(whole)

    # gem plan sums the third-party strategy's own estimate: AdamW in float32 on one rank for
    # every parameter outside the embedding tables, counted here on the model itself.
    result = plan(config, Layout(gpus=1, gpu_memory_gib=1, dense="unit-count",
                                 embedding="replicated"), plugins)
    model = plugins.resolve("model", "mean-history", None).impl
    built = model(config.model, build_plugins().data_source(config.data, seed=0).schema,
                  attention=ReferenceAttention(), embedding_backend=ReferenceEmbeddingBackend(),
                  norm=None)
    dense = sum(p.numel() for name, p in built.named_parameters()
                if not name.startswith("embeddings."))
    memory = result["memory_bytes_per_rank"]
    assert (memory["dense_params"], memory["dense_grads"], memory["dense_optimizer"]) == \
        (dense * 4, dense * 4, dense * 8)
    assert result["unit_count"] == {"ranks": 1} and result["complete"]
    assert result["memory_bytes_per_rank_by_category"]["activations"] > 0
    silent = plan(config, Layout(gpus=1, gpu_memory_gib=1, dense="silent",
                                 embedding="replicated"), plugins)
    assert silent["no_estimate"] == ["dense_sharding 'silent' gives no estimate: its memory "
                                     "and traffic are not in the totals"]
    assert not silent["complete"] and "dense_params" not in silent["memory_bytes_per_rank"]


def test_a_model_plugin_whose_product_lacks_the_contracts_is_refused_by_name():
    import types

    from gem_core import hookimpl
    from gem_core.config import ModelConfig
    from gem_core.errors import GemPluginError
    from gem_core.model.building import build_checked
    from gem_core.plugins import build_plugins
    from gem_core.registry import ImplementationSpec

    def register(register):
        register(ImplementationSpec(name="plain", load=lambda: lambda *args, **kwargs:
                                    PlainModel()))

    plugins = build_plugins(load_entry_points=False, extra_plugins=[
        ("plain_models", types.SimpleNamespace(gem_register_models=hookimpl(register)))])
    with pytest.raises(GemPluginError) as raised:
        build_checked(plugins.resolve("model", "plain", None), ModelConfig(), None,
                      attention=None, embedding_backend=None, norm=None)
    message = str(raised.value)
    assert "model 'plain' (plugin plain_models" in message and "PlainModel" in message
    assert "RankingModel" in message and "flops" in message
