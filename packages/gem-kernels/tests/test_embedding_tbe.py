"""Conformance of the ``fbgemm-tbe`` embedding backend (FBGEMM table-batched embeddings with a
fused optimizer) against the reference backend and a float64 re-implementation of its optimizer
step; checkpoint and resume of its weights and optimizer state in a real training run."""

from __future__ import annotations

import json

import attrs
import pytest
import torch

pytest.importorskip("fbgemm_gpu")

from gem_core.checkpoint.checkpointer import read_checkpoint  # noqa: E402
from gem_core.config import EmbeddingOptimizerConfig, ModelConfig, TrainConfig, load_config  # noqa: E402
from gem_core.embedding import (  # noqa: E402
    EmbeddingTableConfig,
    ReferenceEmbeddingCollection,
    check_fused_optimizer,
)
from gem_core.errors import GemConfigError  # noqa: E402
from gem_core.jagged import Jagged  # noqa: E402
from gem_core.plugins import build_plugins  # noqa: E402
from gem_core.registry import ImplementationSpec  # noqa: E402
from gem_core.train.optim import make_optimizer  # noqa: E402
from gem_core.train.trainer import train  # noqa: E402
from gem_core.trained_run import load_run  # noqa: E402
from gem_kernels.embedding_tbe import TbeEmbeddingCollection  # noqa: E402

DIM = 8
DEFAULT_OPTIMIZER = EmbeddingOptimizerConfig()  # frozen: one shared default is safe


def _tables(optimizer: EmbeddingOptimizerConfig = DEFAULT_OPTIMIZER):
    """Pooled (sum, mean) and sequence tables; two features share table ``a``, and the feature
    order interleaves tables (the backend must order them for FBGEMM's CPU Adagrad)."""
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


def _features() -> dict[str, Jagged]:
    """Three requests; empty bags (c1's second, c2's first, c3's second) and an empty sequence
    feature (e2); repeated ids within and across features."""
    def jagged(values, offsets):
        return Jagged(torch.tensor(values, dtype=torch.int64),
                      torch.tensor(offsets, dtype=torch.int64))

    return {"c1": jagged([1, 2, 2, 10], [0, 3, 3, 4]), "c2": jagged([0, 2], [0, 0, 1, 2]),
            "c3": jagged([6, 5, 4], [0, 2, 2, 3]), "e1": jagged([12, 0, 3, 0], [0, 2, 4]),
            "e2": jagged([], [0, 0]), "e3": jagged([4, 4, 1], [0, 3])}


def _pair(optimizer: EmbeddingOptimizerConfig = DEFAULT_OPTIMIZER):
    torch.manual_seed(7)
    tbe = TbeEmbeddingCollection(_tables(optimizer))
    torch.manual_seed(7)
    reference = ReferenceEmbeddingCollection(_tables(optimizer))
    return tbe, reference


def _upstream(outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {k: torch.randn(v.shape, generator=generator) for k, v in outputs.items()}


def test_lookups_and_initial_weights_equal_the_reference():
    tbe, reference = _pair()
    for name in reference.table_configs:  # drawn as the reference draws them
        assert torch.equal(tbe.tables[name].weight, reference.tables[name].weight)
    with torch.no_grad():
        for name in reference.table_configs:  # not the initial draw: lookups of other values
            reference.tables[name].weight.mul_(3.0).add_(0.25)
    tbe.to("cpu").float()  # what a trainer does: the buffers stay views of TBE's weights
    with pytest.raises(GemConfigError, match="keeps its tables in float32"):
        tbe.bfloat16()
    tbe.load_state_dict(reference.state_dict())
    got, expected = tbe(_features()), reference(_features())
    assert got.keys() == expected.keys()
    for key in expected:
        assert got[key].shape == expected[key].shape, key
        torch.testing.assert_close(got[key], expected[key], rtol=1e-6, atol=1e-6, msg=key)
    assert got["e2"].shape == (0, DIM) and got["c1"][1].abs().sum() == 0


def test_sgd_step_is_minus_the_reference_gradient():
    """SGD with lr = 1 updates every table by minus the reference's gradient: the fused update
    sees the same gradient (sum and mean pooling, shared tables, duplicates summed)."""
    tbe, reference = _pair(EmbeddingOptimizerConfig(name="sgd", lr=1.0))
    before = {name: tbe.tables[name].weight.clone() for name in reference.table_configs}
    outputs = reference(_features())
    upstream = _upstream(outputs)
    sum((outputs[k] * upstream[k]).sum() for k in outputs).backward()
    tbe_outputs = tbe(_features())
    sum((tbe_outputs[k] * upstream[k]).sum() for k in tbe_outputs).backward()
    for name, table in reference.tables.items():
        assert table.weight.grad.abs().sum() > 0, name
        torch.testing.assert_close(tbe.tables[name].weight - before[name], -table.weight.grad,
                                   rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("decay", [(0.0, "l2"), (0.3, "l2"), (0.3, "decoupled")],
                         ids=["no-decay", "l2", "decoupled"])
def test_rowwise_adagrad_step_matches_float64(decay):
    weight_decay, mode = decay
    options = EmbeddingOptimizerConfig(lr=0.1, eps=1e-3, weight_decay=weight_decay,
                                       weight_decay_mode=mode)
    tbe, reference = _pair(options)
    generator = torch.Generator().manual_seed(5)
    momenta = tbe.momenta()
    with torch.no_grad():  # a state as after earlier steps, not zeros
        for state in momenta.values():
            state.copy_(torch.rand(state.shape, generator=generator))
    weights0 = {n: tbe.tables[n].weight.double().clone() for n in reference.table_configs}
    momenta0 = {n: m.double().clone() for n, m in momenta.items()}
    outputs = reference(_features())
    upstream = _upstream(outputs)
    sum((outputs[k] * upstream[k]).sum() for k in outputs).backward()
    tbe_outputs = tbe(_features())
    sum((tbe_outputs[k] * upstream[k]).sum() for k in tbe_outputs).backward()
    for name, table in reference.tables.items():
        grad, weight, momentum = table.weight.grad.double(), weights0[name], momenta0[name]
        rows = grad.abs().sum(dim=1) > 0  # only the rows the batch looked up change
        if mode == "l2":
            grad = grad + weight_decay * weight
        new_momentum = momentum + (grad ** 2).mean(dim=1)
        step = 0.1 * grad / (new_momentum.sqrt()[:, None] + 1e-3)
        if mode == "decoupled":
            step = step + 0.1 * weight_decay * weight
        expected_weight = torch.where(rows[:, None], weight - step, weight)
        expected_momentum = torch.where(rows, new_momentum, momentum)
        torch.testing.assert_close(tbe.tables[name].weight.double(), expected_weight,
                                   rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(momenta[name].double(), expected_momentum,
                                   rtol=1e-5, atol=1e-6, msg=name)
        assert rows.any() and not rows.all(), name


def test_dense_schedule_scales_the_fused_learning_rate():
    options = EmbeddingOptimizerConfig(name="sgd", lr=0.5, lr_schedule="dense")
    tbe, _ = _pair(options)
    constant, _ = _pair(attrs.evolve(options, lr_schedule="constant"))
    assert tbe.follow_learning_rate(0.25) == 0.125 and constant.follow_learning_rate(0.25) == 0.5
    steps = []
    for module in (tbe, constant):
        before = {n: w.clone() for n, w in module.state_dict().items()}
        outputs = module(_features())
        sum((outputs[k] * _upstream(outputs)[k]).sum() for k in outputs).backward()
        steps.append({n: module.state_dict()[n] - before[n] for n in before})
    for name, step in steps[0].items():
        assert step.abs().sum() > 0
        torch.testing.assert_close(step * 4, steps[1][name], rtol=1e-5, atol=1e-7)


def test_evaluation_mode_lookups_update_nothing():
    """A backward outside training (FP8 calibration runs its backward passes in eval mode)
    must not step the fused optimizer."""
    tbe, _ = _pair(EmbeddingOptimizerConfig(name="sgd", lr=1.0))
    before = {n: w.clone() for n, w in tbe.state_dict().items()}
    scale = torch.ones((), requires_grad=True)
    outputs = tbe.eval()(_features())
    assert not any(v.requires_grad for v in outputs.values())
    sum((v * scale).sum() for v in outputs.values()).backward()
    assert scale.grad != 0
    for name, weight in tbe.state_dict().items():
        assert torch.equal(weight, before[name]), name


def test_out_of_range_id_raises_the_reference_error():
    tbe, reference = _pair()
    features = _features()
    features["e3"] = Jagged(torch.tensor([4, 5]), torch.tensor([0, 2]))
    with pytest.raises(ValueError) as expected:
        reference(features)
    with pytest.raises(ValueError) as got:
        tbe(features)
    assert str(got.value) == str(expected.value)
    assert "'u'" in str(got.value) and "id 5" in str(got.value)


def test_tables_are_not_dense_parameters_and_keep_the_reference_names():
    tbe, reference = _pair()
    model = torch.nn.ModuleDict({"embeddings": tbe, "head": torch.nn.Linear(DIM, 1)})
    optimizer = make_optimizer(TrainConfig())(model)
    owned = {p.data_ptr() for group in optimizer.param_groups for p in group["params"]}
    assert owned == {p.data_ptr() for p in model["head"].parameters()}
    assert not list(tbe.parameters())
    assert set(tbe.state_dict()) == set(reference.state_dict())  # load_run reads either way
    assert set(tbe.sharded_checkpoint_state()["optimizer"]) == {
        f"tables.{name}.weight" for name in reference.table_configs}


def test_start_up_checks_name_the_problem():
    fused = ImplementationSpec(name="fbgemm-tbe", load=object, capabilities=("fused_optimizer",))
    plain = ImplementationSpec(name="reference", load=object)
    replicated = ImplementationSpec(name="replicated", load=object)
    torchrec = ImplementationSpec(name="torchrec", load=object)
    default = ModelConfig()
    tuned = attrs.evolve(default, embedding_optimizer=EmbeddingOptimizerConfig(name="sgd"))
    check_fused_optimizer(tuned, embedding=fused, embedding_sharding=replicated, world_size=1)
    check_fused_optimizer(default, embedding=plain, embedding_sharding=torchrec, world_size=4)
    with pytest.raises(GemConfigError, match="embedding backend 'reference' trains its tables"):
        check_fused_optimizer(tuned, embedding=plain, embedding_sharding=replicated,
                              world_size=1)
    with pytest.raises(GemConfigError, match="on 2 ranks the replicas would drift apart"):
        check_fused_optimizer(default, embedding=fused, embedding_sharding=replicated,
                              world_size=2)
    with pytest.raises(GemConfigError, match="embedding sharding 'torchrec' would replace"):
        check_fused_optimizer(default, embedding=fused, embedding_sharding=torchrec,
                              world_size=1)
    with pytest.raises(ValueError, match="weight_decay needs name = 'rowwise_adagrad'"):
        EmbeddingOptimizerConfig(name="sgd", weight_decay=0.1)


RUN = ["train.steps=4", "train.checkpoint_every=2", "train.batch_size=16", "data.eval_rows=64",
       "train.eval_batch_size=64", "train.warmup_steps=1", "train.eval_every=0",
       "data.max_seq_len=12", "model.interaction_dims=[16]", "model.num_layers=1",
       "train.deterministic=true", "backends.embedding=fbgemm-tbe"]


def _losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines)]


def test_checkpoint_and_resume_equal_an_uninterrupted_run(tmp_path, caplog):
    config = load_config(preset="tiny", overrides=RUN)
    plugins = build_plugins()
    assert "fused_optimizer" in plugins.registry("embedding").get("fbgemm-tbe").capabilities
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    with caplog.at_level("WARNING", logger="gem_core.train.assembly"):
        train(config, plugins, whole, progress=False)
    # the preset's embedding_lr_scale reaches no table here, and the start-up log says so
    assert config.train.embedding_lr_scale != 1.0
    assert ("train.embedding_lr_scale = 5 applies to none of this run's feature tables: the "
            "embedding backend 'fbgemm-tbe' trains them with [model.embedding_optimizer] "
            "(rowwise_adagrad, lr 0.02)") in caplog.text
    # The interrupted run saves in the background (the fused state is staged to CPU too).
    background = load_config(preset="tiny", overrides=RUN + ["train.async_checkpoint=true"])
    train(background, plugins, parts, progress=False, until_step=2)
    stopped = read_checkpoint(parts / "checkpoints" / "step-00000002")
    resumed = train(background, plugins, parts, progress=False)
    assert resumed.summary["run"]["resumed_from"] == 2
    assert _losses(parts) == _losses(whole)
    final = [read_checkpoint(run / "checkpoints" / "step-00000004")["engine"]
             for run in (whole, parts)]
    tables = [k for k in final[0]["model"] if k.startswith("embeddings.tables.")]
    momenta = [k for k in final[0]["optimizer"]["state"] if k.startswith("embeddings.tables.")]
    assert tables and set(momenta) == set(tables)  # one momentum1 per table, same name
    for key in tables:
        assert torch.equal(final[0]["model"][key], final[1]["model"][key]), key
        # the weights trained between the checkpoints: resuming loaded the step-2 tables
        assert not torch.equal(final[0]["model"][key], stopped["engine"]["model"][key]), key
    for key in momenta:
        saved = final[0]["optimizer"]["state"][key]["momentum1"]
        assert saved.abs().sum() > 0, key
        assert torch.equal(saved, final[1]["optimizer"]["state"][key]["momentum1"]), key
        assert not torch.equal(saved, stopped["engine"]["optimizer"]["state"][key]["momentum1"])
    # the dense AdamW never held a table: no Adam moments under the tables' names
    assert not any("exp_avg" in final[0]["optimizer"]["state"][k] for k in momenta)
    # a finished run opens with its own backend and with the reference one (same names)
    for backend in ("fbgemm-tbe", "reference"):
        loaded = load_run(whole, plugins=plugins, backends={"embedding": backend})
        for key in tables:
            name = key.split(".")[2]
            assert torch.equal(loaded.model.embeddings.tables[name].weight,
                               final[0]["model"][key]), (backend, key)
    # the fused state cannot continue in AdamW: resuming with the reference backend is refused
    plain = load_config(preset="tiny", overrides=RUN[:-1] + ["train.steps=6"])
    with pytest.raises(GemConfigError, match="resume with --set backends.embedding=fbgemm-tbe"):
        train(plain, plugins, whole, progress=False)
