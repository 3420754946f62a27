"""MoE in the training loop: the load-balancing loss is trained with the task loss, expert loads
go to metrics.jsonl and dropped tokens to summary.json; models without MoE write none of it.
And the loss does its job: it evens out a skewed router in a short run."""

from __future__ import annotations

import json

import pytest
import torch

from gem_core.config import load_config
from gem_core.model.moe import MixtureOfExperts
from gem_core.plugins import build_plugins
from gem_core.train.trainer import train

SMALL = ["train.steps=4", "train.batch_size=32", "data.eval_rows=128",
         "train.eval_batch_size=128", "train.warmup_steps=1", "train.eval_every=0",
         "train.checkpoint_every=0", "data.max_seq_len=32", "train.device=cpu"]


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_tiny_moe_writes_expert_loads_and_dropped_tokens(tmp_path):
    config = load_config(preset="tiny-moe", overrides=[*SMALL, "model.moe.capacity_factor=1.0"])
    result = train(config, build_plugins(), tmp_path / "moe", progress=False)
    records = _metrics(tmp_path / "moe")
    assert len(records) == 4
    dropped = 0.0
    for record in records:
        loads = record["moe_tokens_per_expert"]
        assert sorted(loads) == ["tower.blocks.0.mlp", "tower.blocks.1.mlp"]
        for counts in loads.values():
            assert len(counts) == 4
            # top-2: every token is routed twice (before capacity)
            assert sum(counts) == 2 * (record["tokens"] - (records[records.index(record) - 1]
                                                           ["tokens"] if record["step"] > 1
                                                           else 0))
        for name, ratio in record["moe_load_max_over_mean"].items():
            counts = loads[name]
            assert ratio == pytest.approx(max(counts) / (sum(counts) / len(counts)))
        assert record["moe_load_max_over_mean_worst"] == max(
            record["moe_load_max_over_mean"].values())
        assert record["aux_loss"] >= 2 * 0.01 * 0.99  # two layers, each >= ~1 x weight
        dropped += record["moe_dropped_tokens"]
    assert result.summary["moe"]["dropped_tokens"] == dropped
    summary = json.loads((tmp_path / "moe" / "summary.json").read_text())
    assert summary["moe"]["dropped_tokens"] == dropped
    assert summary["config"]["model"]["moe"]["num_experts"] == 4


def test_models_without_moe_write_no_moe_figures(tmp_path):
    result = train(load_config(preset="tiny", overrides=SMALL), build_plugins(),
                   tmp_path / "dense", progress=False)
    record = _metrics(tmp_path / "dense")[0]
    assert not any(key.startswith(("moe", "aux")) for key in record)
    assert "moe" not in result.summary


def _skewed_layer(aux_weight: float) -> MixtureOfExperts:
    torch.manual_seed(0)
    layer = MixtureOfExperts("swiglu", 16, 32, 16, num_experts=4, top_k=1, capacity_factor=0.0,
                             shared_expert=False, aux_loss_weight=aux_weight, impl="grouped")
    with torch.no_grad():  # a router that sends most tokens to expert 0
        layer.router.weight[0] += 0.5
    return layer


def _train_and_measure(aux_weight: float, steps: int = 30) -> tuple[float, float]:
    layer = _skewed_layer(aux_weight)
    optimizer = torch.optim.Adam(layer.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    target = torch.nn.Linear(16, 16)  # a task for the experts: fit a random linear map
    loads = []
    for _ in range(steps):
        x = torch.randn(256, 16, generator=generator) + 0.3
        out = layer(x)
        task = (out - target(x).detach()).pow(2).mean()
        counts = layer.last_stats["tokens"].double()
        loads.append(float(counts.max() / counts.mean()))
        optimizer.zero_grad()
        (task + layer.last_aux_loss).backward()
        optimizer.step()
    return loads[0], loads[-1]


def test_load_balancing_loss_evens_out_a_skewed_router():
    start, balanced = _train_and_measure(aux_weight=0.1)
    _, unbalanced = _train_and_measure(aux_weight=0.0)
    assert start > 2.0  # skewed: the busiest expert takes over half the tokens
    assert balanced < 1.3 < unbalanced
