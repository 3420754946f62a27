"""The ``budget`` activation-checkpointing policy: the compiler recomputes under an activation
memory budget. A small budget saves activations and computes the same gradients; the
policy is refused without ``train.compile`` and its option is checked."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from gem_core.attention import AttentionParams
from gem_core.attention.padded import PaddedAttention
from gem_core.compile import compile_module, compiler_settings, use_inductor_cache
from gem_core.config import load_config
from gem_core.errors import GemConfigError
from gem_core.jagged import offsets_from_lengths
from gem_core.model.sequence_tower import SequenceTower
from gem_core.plugins import build_plugins
from gem_core.train.trainer import train
from gem_parallel.auto_ac import BudgetCheckpointing, BudgetOptions


def _saved_bytes_and_grads(tower: SequenceTower, x, offsets, max_len):
    """Bytes of the distinct storages autograd keeps for the backward, and the gradients."""
    storages: dict[int, int] = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    tower.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = tower(x, offsets, max_len)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return sum(storages.values()), {n: p.grad.clone() for n, p in tower.named_parameters()}


@pytest.mark.slow
def test_a_small_budget_saves_activations_and_computes_the_same_gradients():
    use_inductor_cache(Path(__file__).resolve().parents[3] / ".cache" / "inductor")
    torch.manual_seed(0)
    tower = SequenceTower(16, 2, 1, 64, AttentionParams(causal=True, window=8), PaddedAttention())
    lengths = torch.tensor([7, 2, 12, 5])
    x, offsets = torch.randn(int(lengths.sum()), 16), offsets_from_lengths(lengths)
    eager_saved, expected = _saved_bytes_and_grads(tower, x, offsets, 12)
    compiled = copy.deepcopy(tower)
    settings = compiler_settings(BudgetCheckpointing(), BudgetOptions(memory_budget=0.2))
    assert settings == {"activation_memory_budget": 0.2}
    compile_module(compiled.blocks[0], settings=settings)
    saved, grads = _saved_bytes_and_grads(compiled, x, offsets, 12)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    # The default partition (budget 1) keeps 0.93x of eager's activations at gem bench memory's
    # shapes (docs/perf.md); budget 0.2 must keep far less.
    assert saved < 0.5 * eager_saved


def test_memory_budget_option_is_checked():
    def resolve(options):
        return build_plugins().resolve("activation_checkpointing", "budget", None, options)

    budget = resolve({})
    assert budget.impl.compiler_settings(budget.options) == {"activation_memory_budget": 0.5}
    for bad in (0, 1.5, -0.1):
        with pytest.raises(GemConfigError, match=r"memory_budget.*\(0, 1\]"):
            resolve({"memory_budget": bad})
    with pytest.raises(GemConfigError,
                       match="unknown key 'parallel.activation_checkpointing.budget'"):
        resolve({"budget": 0.5})


def test_budget_is_registered_and_refused_without_compile(tmp_path):
    plugins = build_plugins()
    names = {spec.name for spec in plugins.registry("activation_checkpointing").specs()}
    assert "budget" in names
    config = load_config(preset="tiny", overrides=[
        "train.steps=1", "train.batch_size=4", "data.max_seq_len=8", "data.eval_rows=8",
        "train.device=cpu", "backends.activation_checkpointing=budget",
        "parallel.activation_checkpointing={memory_budget=0.3}"])
    with pytest.raises(GemConfigError, match="'budget'.*activation_memory_budget.*"
                                             "train.compile = true"):
        train(config, plugins, tmp_path / "run", progress=False)
