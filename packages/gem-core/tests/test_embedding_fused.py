"""Conformance of the ``reference-fused`` embedding backend (plain PyTorch tables with
``fbgemm-tbe``'s fused optimizer in the backward): against a float64 loop implementation of
FBGEMM's exact row-wise Adagrad and SGD, against ``fbgemm-tbe`` itself where ``fbgemm_gpu`` is
installed, against the reference backend (lookups, initial weights, names), and its checkpoint
contract; one short training run."""

from __future__ import annotations

import json
import math

import attrs
import pytest
import torch

from gem_core.config import EmbeddingOptimizerConfig, TrainConfig, load_config
from gem_core.embedding import EmbeddingTableConfig, ReferenceEmbeddingCollection
from gem_core.embedding_fused import FusedEmbeddingCollection
from gem_core.errors import GemConfigError
from gem_core.jagged import Jagged
from gem_core.plugins import build_plugins
from gem_core.train.optim import make_optimizer

DIM = 4
DEFAULT_OPTIMIZER = EmbeddingOptimizerConfig()

OPTIMIZERS = {
    "adagrad": EmbeddingOptimizerConfig(lr=0.1, eps=1e-3),
    "l2": EmbeddingOptimizerConfig(lr=0.1, eps=1e-3, weight_decay=0.3, weight_decay_mode="l2"),
    "decoupled": EmbeddingOptimizerConfig(lr=0.1, eps=1e-3, weight_decay=0.3,
                                          weight_decay_mode="decoupled"),
    "sgd": EmbeddingOptimizerConfig(name="sgd", lr=0.7),
}


def _tables(optimizer: EmbeddingOptimizerConfig = DEFAULT_OPTIMIZER):
    """Pooled (sum, mean) and sequence tables; two features share ``a`` and two share ``s``."""
    return [
        EmbeddingTableConfig(name="a", num_embeddings=11, dim=DIM, pooling="sum",
                             features=("c1", "c2"), optimizer=optimizer),
        EmbeddingTableConfig(name="b", num_embeddings=7, dim=DIM, pooling="mean",
                             features=("c3",), optimizer=optimizer),
        EmbeddingTableConfig(name="s", num_embeddings=13, dim=DIM, pooling="none",
                             features=("e1", "e2"), optimizer=optimizer),
        EmbeddingTableConfig(name="u", num_embeddings=5, dim=DIM, pooling="none",
                             features=("e3",), optimizer=optimizer),
    ]


def _jagged(values, offsets) -> Jagged:
    return Jagged(torch.tensor(values, dtype=torch.int64),
                  torch.tensor(offsets, dtype=torch.int64))


def _features() -> dict[str, Jagged]:
    """Empty bags (c1's second, c2's first, c3's second), an empty sequence feature (e2),
    repeated ids within a bag, across bags and across the features of one table."""
    return {"c1": _jagged([1, 2, 2, 10], [0, 3, 3, 4]), "c2": _jagged([0, 2], [0, 0, 1, 2]),
            "c3": _jagged([6, 5, 4], [0, 2, 2, 3]), "e1": _jagged([12, 0, 3, 0], [0, 2, 4]),
            "e2": _jagged([], [0, 0]), "e3": _jagged([4, 4, 1], [0, 3])}


def _random_features(generator: torch.Generator) -> dict[str, Jagged]:
    """Three bags per pooled feature, lengths 0..4 (some empty), ids from a small range so they
    repeat; the first step's batch is the fixed one above."""
    out = {}
    for table in _tables():
        for feature in table.features:
            lengths = torch.randint(0, 5, (3,), generator=generator)
            ids = torch.randint(0, table.num_embeddings, (int(lengths.sum()),),
                                generator=generator)
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
            if table.pooling == "none":
                offsets = torch.tensor([0, ids.numel()])
            out[feature] = Jagged(ids, offsets)
    return out


def _batches(steps: int) -> list[dict[str, Jagged]]:
    generator = torch.Generator().manual_seed(11)
    return [_features()] + [_random_features(generator) for _ in range(steps - 1)]


def _upstream(outputs: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=generator, dtype=v.dtype)
            for k, v in sorted(outputs.items())}


def _step(module, features, seed: int) -> None:
    outputs = module(features)
    upstream = _upstream(outputs, seed)
    sum((outputs[k] * upstream[k]).sum() for k in outputs).backward()


def _randomise_momenta(module, seed: int = 5) -> None:
    """A state as after earlier steps, not zeros."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, state in sorted(module.momenta().items()):
            state.copy_(torch.rand(state.shape, generator=generator, dtype=torch.float64))


# -- the float64 oracle: plain Python over rows ------------------------------------------------

def _oracle_step(weights, momenta, features, upstream, options: EmbeddingOptimizerConfig):
    """FBGEMM's exact row-wise Adagrad / SGD, one table at a time, written out as loops over
    lists of floats; ``weights[name][row]`` and ``momenta[name][row]`` are updated in place."""
    for table in _tables():
        grads: dict[int, list[float]] = {}  # row -> summed gradient, duplicates summed first
        for feature in table.features:
            ids, offsets = features[feature].values.tolist(), features[feature].offsets.tolist()
            grad = upstream[feature].tolist()
            if table.pooling == "none":
                pairs = [(row, grad[i], 1) for i, row in enumerate(ids)]
            else:
                pairs = [(ids[i], grad[bag], offsets[bag + 1] - offsets[bag])
                         for bag in range(len(offsets) - 1)
                         for i in range(offsets[bag], offsets[bag + 1])]
            for row, g, count in pairs:
                scale = 1.0 / count if table.pooling == "mean" else 1.0
                total = grads.setdefault(row, [0.0] * DIM)
                for d in range(DIM):
                    total[d] += g[d] * scale
        w, m = weights[table.name], momenta.get(table.name)
        for row, g in grads.items():
            if options.name == "sgd":
                w[row] = [w[row][d] - options.lr * g[d] for d in range(DIM)]
                continue
            decay = options.weight_decay
            if options.weight_decay_mode == "l2":
                g = [g[d] + decay * w[row][d] for d in range(DIM)]
            m[row] += sum(x * x for x in g) / DIM
            multiplier = options.lr / (math.sqrt(m[row]) + options.eps)
            if options.weight_decay_mode == "decoupled":
                w[row] = [w[row][d] - multiplier * g[d] - options.lr * decay * w[row][d]
                          for d in range(DIM)]
            else:
                w[row] = [w[row][d] - multiplier * g[d] for d in range(DIM)]


@pytest.mark.parametrize("which", sorted(OPTIMIZERS))
def test_steps_equal_a_float64_loop_implementation(which):
    options = OPTIMIZERS[which]
    torch.manual_seed(7)
    module = FusedEmbeddingCollection(_tables(options)).double()
    _randomise_momenta(module)
    weights = {n: module.tables[n].weight.tolist() for n in module.table_configs}
    momenta = {n: m.tolist() for n, m in module.momenta().items()}
    assert (which == "sgd") == (not momenta)
    for step, features in enumerate(_batches(4)):
        before = {n: module.tables[n].weight.clone() for n in module.table_configs}
        outputs = module(features)
        upstream = _upstream(outputs, seed=100 + step)
        sum((outputs[k] * upstream[k]).sum() for k in outputs).backward()
        _oracle_step(weights, momenta, features, upstream, options)
        for name in module.table_configs:
            got = module.tables[name].weight
            torch.testing.assert_close(got, torch.tensor(weights[name], dtype=torch.float64),
                                       rtol=1e-12, atol=1e-12, msg=f"{name} step {step}")
            touched = (got != before[name]).any(dim=1)
            looked_up = torch.cat([features[f].values for f in module.table_configs[name].features])
            assert torch.equal(touched, torch.isin(torch.arange(got.shape[0]), looked_up)), name
        for name, state in module.momenta().items():
            torch.testing.assert_close(state, torch.tensor(momenta[name], dtype=torch.float64),
                                       rtol=1e-12, atol=1e-12, msg=f"{name} step {step}")


# -- against fbgemm-tbe ---------------------------------------------------------------------------

@pytest.mark.parametrize("which", sorted(OPTIMIZERS))
def test_three_steps_equal_fbgemm_tbe(which):
    pytest.importorskip("fbgemm_gpu")
    from gem_kernels.embedding_tbe import TbeEmbeddingCollection

    options = OPTIMIZERS[which]
    torch.manual_seed(7)
    tbe = TbeEmbeddingCollection(_tables(options))
    torch.manual_seed(7)
    fused = FusedEmbeddingCollection(_tables(options))
    for name in fused.table_configs:
        assert torch.equal(tbe.tables[name].weight, fused.tables[name].weight)
    _randomise_momenta(tbe)
    _randomise_momenta(fused)
    for step, features in enumerate(_batches(3)):
        for module in (tbe, fused):
            _step(module, features, seed=100 + step)
        for name in fused.table_configs:
            torch.testing.assert_close(fused.tables[name].weight, tbe.tables[name].weight,
                                       rtol=1e-5, atol=1e-6, msg=f"{name} step {step}")
        assert fused.momenta().keys() == tbe.momenta().keys()
        for name, state in fused.momenta().items():
            torch.testing.assert_close(state, tbe.momenta()[name], rtol=1e-5, atol=1e-6,
                                       msg=f"{name} step {step}")


# -- the reference backend's behaviour --------------------------------------------------------

def _pair(optimizer: EmbeddingOptimizerConfig = DEFAULT_OPTIMIZER):
    torch.manual_seed(7)
    fused = FusedEmbeddingCollection(_tables(optimizer))
    torch.manual_seed(7)
    reference = ReferenceEmbeddingCollection(_tables(optimizer))
    return fused, reference


def test_lookups_initial_weights_and_names_equal_the_reference():
    fused, reference = _pair()
    assert set(fused.state_dict()) == set(reference.state_dict())  # load_run reads either way
    for name in reference.table_configs:
        assert torch.equal(fused.tables[name].weight, reference.tables[name].weight)
    with torch.no_grad():
        for name in reference.table_configs:
            reference.tables[name].weight.mul_(3.0).add_(0.25)
    fused.load_state_dict(reference.state_dict())
    got, expected = fused(_features()), reference(_features())
    assert got.keys() == expected.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key
    assert got["e2"].shape == (0, DIM) and got["c1"][1].abs().sum() == 0
    with pytest.raises(GemConfigError, match="keeps its tables in float32"):
        fused.bfloat16()


def test_sgd_step_is_minus_the_reference_gradient():
    fused, reference = _pair(EmbeddingOptimizerConfig(name="sgd", lr=1.0))
    before = {name: fused.tables[name].weight.clone() for name in reference.table_configs}
    _step(reference, _features(), seed=3)
    _step(fused, _features(), seed=3)
    for name, table in reference.tables.items():
        assert table.weight.grad.abs().sum() > 0, name
        torch.testing.assert_close(fused.tables[name].weight - before[name], -table.weight.grad,
                                   rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("which", sorted(OPTIMIZERS))
def test_distinct_rows_skip_the_summing_and_step_the_same(which):
    """``unique=True`` (a dense gradient's nonzero rows, the dense step's path) steps exactly as
    the summing path does on the same distinct rows, in any order."""
    from gem_core.embedding_fused import rowwise_update

    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(9, DIM, dtype=torch.float64, generator=generator)
    momentum = torch.rand(9, dtype=torch.float64, generator=generator)
    ids = torch.tensor([7, 0, 3, 5])
    grads = torch.randn(4, DIM, dtype=torch.float64, generator=generator)
    summed, fast = (weight.clone(), momentum.clone()), (weight.clone(), momentum.clone())
    rowwise_update(*summed, ids, grads, options=OPTIMIZERS[which], lr=0.05)
    rowwise_update(*fast, ids, grads, options=OPTIMIZERS[which], lr=0.05, unique=True)
    assert not torch.equal(summed[0], weight)
    torch.testing.assert_close(fast[0], summed[0], rtol=0, atol=1e-15)
    torch.testing.assert_close(fast[1], summed[1], rtol=0, atol=1e-15)
    untouched = torch.tensor([1, 2, 4, 6, 8])
    assert torch.equal(fast[0][untouched], weight[untouched])


def test_out_of_range_ids_and_managed_tables_are_refused():
    fused, reference = _pair()
    features = _features()
    features["e3"] = _jagged([4, 5], [0, 2])
    with pytest.raises(ValueError) as expected:
        reference(features)
    with pytest.raises(ValueError) as got:
        fused(features)
    assert str(got.value) == str(expected.value)
    managed = attrs.evolve(_tables()[0], managed=object())
    with pytest.raises(GemConfigError, match="id_policy 'managed'.*does not remap"):
        FusedEmbeddingCollection([managed])


def test_tables_are_not_dense_parameters():
    fused, _ = _pair()
    model = torch.nn.ModuleDict({"embeddings": fused, "head": torch.nn.Linear(DIM, 1)})
    optimizer = make_optimizer(TrainConfig())(model)
    owned = {p.data_ptr() for group in optimizer.param_groups for p in group["params"]}
    assert owned == {p.data_ptr() for p in model["head"].parameters()}
    assert not list(fused.parameters())


def test_dense_schedule_scales_the_fused_learning_rate():
    options = EmbeddingOptimizerConfig(name="sgd", lr=0.5, lr_schedule="dense")
    dense, _ = _pair(options)
    constant, _ = _pair(attrs.evolve(options, lr_schedule="constant"))
    assert dense.follow_learning_rate(0.25) == 0.125 and constant.follow_learning_rate(0.25) == 0.5
    steps = []
    for module in (dense, constant):
        before = {n: w.clone() for n, w in module.state_dict().items()}
        _step(module, _features(), seed=3)
        steps.append({n: module.state_dict()[n] - before[n] for n in before})
    for name, step in steps[0].items():
        assert step.abs().sum() > 0
        torch.testing.assert_close(step * 4, steps[1][name], rtol=1e-5, atol=1e-7)


def test_evaluation_mode_and_no_grad_update_nothing():
    fused, _ = _pair(EmbeddingOptimizerConfig(name="sgd", lr=1.0))
    before = {n: w.clone() for n, w in fused.state_dict().items()}
    scale = torch.ones((), requires_grad=True)
    outputs = fused.eval()(_features())
    assert not any(v.requires_grad for v in outputs.values())
    sum((v * scale).sum() for v in outputs.values()).backward()
    assert scale.grad != 0
    with torch.no_grad():
        assert not any(v.requires_grad for v in fused.train()(_features()).values())
    for name, weight in fused.state_dict().items():
        assert torch.equal(weight, before[name]), name


# -- checkpoints ----------------------------------------------------------------------------------

def test_checkpoint_layout_refuses_other_kinds_and_optimizers():
    fused, _ = _pair()
    layout = fused.checkpoint_layout()
    assert layout["kind"] == "reference-fused" and layout["optimizer"] == "rowwise_adagrad"
    fused.check_checkpoint_layout(layout)
    with pytest.raises(GemConfigError, match="saved as 'fbgemm-tbe', not by reference-fused"):
        fused.check_checkpoint_layout({**layout, "kind": "fbgemm-tbe"})
    with pytest.raises(GemConfigError, match="trained by the fused 'sgd'"):
        fused.check_checkpoint_layout({**layout, "optimizer": "sgd"})
    sgd, _ = _pair(EmbeddingOptimizerConfig(name="sgd"))
    assert sgd.sharded_checkpoint_state() == {"model": {}, "optimizer": {}}
    fused.checkpoint_loaded()


def test_sharded_state_round_trip_continues_the_same():
    options = OPTIMIZERS["decoupled"]
    batches = _batches(4)
    whole, _ = _pair(options)
    for step, features in enumerate(batches[:2]):
        _step(whole, features, seed=100 + step)
    state = whole.sharded_checkpoint_state()
    assert state["model"] == {} and set(state["optimizer"]) == {
        f"tables.{name}.weight" for name in whole.table_configs}
    for name, entry in state["optimizer"].items():  # live: the module's own tensors
        assert entry["momentum1"] is whole.tables[name.split(".")[1]].momentum1
        assert entry["momentum1"].abs().sum() > 0
    saved = {n: {"momentum1": e["momentum1"].clone()} for n, e in state["optimizer"].items()}
    weights = {n: w.clone() for n, w in whole.state_dict().items()}

    torch.manual_seed(99)  # other initial weights: everything comes from the copies
    resumed = FusedEmbeddingCollection(_tables(options))
    resumed.check_checkpoint_layout(whole.checkpoint_layout())
    resumed.load_state_dict(weights)
    with torch.no_grad():
        for name, entry in resumed.sharded_checkpoint_state()["optimizer"].items():
            entry["momentum1"].copy_(saved[name]["momentum1"])  # as DCP loads, in place
    resumed.checkpoint_loaded()
    for step, features in enumerate(batches[2:], start=2):
        for module in (whole, resumed):
            _step(module, features, seed=100 + step)
    for name, weight in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], weight), name
    for name, state in whole.momenta().items():
        assert torch.equal(resumed.momenta()[name], state), name


def test_to_moves_weights_and_momenta_together():
    fused, _ = _pair()
    moved = fused.to(torch.float64)
    assert moved is fused
    for name, table in fused.tables.items():
        assert table.weight.dtype == table.momentum1.dtype == torch.float64, name
        assert fused.sharded_checkpoint_state()["optimizer"][f"tables.{name}.weight"][
            "momentum1"] is table.momentum1
    if torch.cuda.is_available():
        fused.to("cuda")
        assert {t.device.type for n, t in fused.named_buffers()} == {"cuda"}
        _step(fused, {k: v.to("cuda") for k, v in _features().items()}, seed=3)


# -- registration and one training run -----------------------------------------------------------

RUN = ["train.steps=2", "train.checkpoint_every=1", "train.batch_size=16", "data.eval_rows=32",
       "train.eval_batch_size=32", "train.warmup_steps=1", "train.eval_every=0",
       "data.max_seq_len=8", "model.interaction_dims=[16]", "model.num_layers=1",
       "train.deterministic=true", "backends.embedding=reference-fused"]


def _losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if "loss" in r]


def test_a_short_training_run_trains_the_tables_and_resumes_exactly(tmp_path):
    from gem_core.checkpoint.checkpointer import read_checkpoint
    from gem_core.train.trainer import train

    plugins = build_plugins()
    spec = plugins.registry("embedding").get("reference-fused")
    assert "fused_optimizer" in spec.capabilities
    config = load_config(preset="tiny", overrides=RUN)
    assert config.data.source == "synthetic"
    train(config, plugins, tmp_path / "run", progress=False)
    losses = _losses(tmp_path / "run")
    assert len(losses) == 2 and all(math.isfinite(loss) for _, loss in losses)
    checkpoints = tmp_path / "run" / "checkpoints"
    first, second = (read_checkpoint(checkpoints / f"step-0000000{s}")["engine"] for s in (1, 2))
    tables = [k for k in second["model"] if k.startswith("embeddings.tables.")]
    momenta = [k for k in second["optimizer"]["state"] if k.startswith("embeddings.tables.")]
    assert tables and set(momenta) == set(tables)
    assert any(not torch.equal(first["model"][k], second["model"][k]) for k in tables)
    for key in momenta:  # the fused optimizer's state, never AdamW's moments
        assert set(second["optimizer"]["state"][key]) == {"momentum1"}, key
        assert second["optimizer"]["state"][key]["momentum1"].abs().sum() > 0, key
    # stopped after step 1 and resumed: the weights and momenta of step 1 carry over
    train(config, plugins, tmp_path / "parts", progress=False, until_step=1)
    resumed = train(config, plugins, tmp_path / "parts", progress=False)
    assert resumed.summary["run"]["resumed_from"] == 1
    assert _losses(tmp_path / "parts") == losses
    final = read_checkpoint(tmp_path / "parts" / "checkpoints" / "step-00000002")["engine"]
    for key in tables:
        assert torch.equal(final["model"][key], second["model"][key]), key
    for key in momenta:
        assert torch.equal(final["optimizer"]["state"][key]["momentum1"],
                           second["optimizer"]["state"][key]["momentum1"]), key
