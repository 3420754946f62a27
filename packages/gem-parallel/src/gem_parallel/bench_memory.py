"""``gem bench memory``: activation memory and recompute FLOPs of each checkpointing policy.

On CPU there is no allocator peak to read, so memory is what autograd keeps for the backward:
the bytes of the distinct storages packed by ``saved_tensors_hooks`` during one forward (inside a
checkpointed region torch.utils.checkpoint installs its own hooks and keeps only the region's
inputs, so those activations are not counted: exactly the memory it saves). FLOPs come from
``torch.utils.flop_counter`` over forward + backward; the difference to no checkpointing is the
recomputation.

The ``budget-*`` rows are the ``budget`` policy: the sequence blocks compiled (``train.compile``)
with the compiler's activation memory budget at 1.0, 0.5, 0.2 (1.0: compiled, default partition).
The same saved-tensor hooks see what the compiled blocks save for their backward. Their FLOPs are
not counted (the flop counter does not see inside inductor's kernels); their first step's compile
time is (``compile_s``). Every row runs the ``padded`` attention backend, which compiles whole.
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from typing import Any, Sequence

import click
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from gem_core.compile import inductor_cache_in_use
from gem_core.distributed import ParallelContext
from gem_core.train.loss import mean_loss

POLICIES: dict[str, dict[str, Any]] = {
    "none": {},
    "full": {},
    "selective-attention": {"modules": ["attention"]},
    "selective-mlp": {"modules": ["mlp"]},
    "selective-attention-mlp": {"modules": ["attention", "mlp"]},
}


def saved_activation_bytes(model: nn.Module, batch, tasks: Sequence[str]) -> int:
    """Bytes autograd holds for the backward after one forward (distinct storages)."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = mean_loss(model(batch), batch, tasks)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


def train_flops(model: nn.Module, batch, tasks: Sequence[str]) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        mean_loss(model(batch), batch, tasks).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def step_times_s(models: dict[str, nn.Module], batch, tasks: Sequence[str], repeats: int
                 ) -> dict[str, float]:
    """Median forward+backward time of each model, the models taking turns step by step so that
    a change of machine load hits every one alike. Each has already run (one-off costs paid)."""
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            started = time.perf_counter()
            mean_loss(model(batch), batch, tasks).backward()
            times[name].append(time.perf_counter() - started)
            model.zero_grad(set_to_none=True)
    return {name: statistics.median(values) for name, values in times.items()}


def apply_policy(model: nn.Module, policy: str) -> nn.Module:
    from gem_parallel.checkpointing import (
        FullCheckpointing,
        SelectiveCheckpointing,
        SelectiveOptions,
    )

    model = copy.deepcopy(model)
    if policy == "none":
        return model
    if policy == "full":
        return FullCheckpointing().apply(model, ctx=ParallelContext(), options=None)
    return SelectiveCheckpointing().apply(model, ctx=ParallelContext(),
                                          options=SelectiveOptions(**POLICIES[policy]))


def compiled_budget(base: nn.Module, budget: float, batch, tasks: Sequence[str]
                    ) -> tuple[nn.Module, dict[str, Any]]:
    """A row of the ``budget`` policy: a copy of ``base`` with its blocks compiled under the
    activation memory budget; its first step's compile time and saved bytes."""
    from gem_core.compile import CompileTracker, compile_module
    from gem_core.contracts import require_strategy_model

    model = copy.deepcopy(base)
    for unit in require_strategy_model(model, "gem bench memory", "parallel_units"
                                       ).parallel_units():
        compile_module(unit, settings={"activation_memory_budget": budget})
    with CompileTracker() as tracker:
        mean_loss(model(batch), batch, tasks).backward()
        model.zero_grad(set_to_none=True)
        first_compile_s = tracker.seconds
        entry = {"saved_activation_bytes": saved_activation_bytes(model, batch, tasks),
                 "train_flops": None}
    entry["compile_s"] = first_compile_s
    # Anything compiled after the first step (a guard that failed): reported, not hidden.
    entry["compile_s_after_first_step"] = tracker.seconds - first_compile_s
    return model, entry


def measure(*, batch_size: int, max_seq_len: int, layers: int, dim: int,
            repeats: int, budgets: Sequence[float] = ()) -> dict[str, Any]:
    from gem_core.attention.padded import PaddedAttention
    from gem_core.config import DataConfig, ModelConfig
    from gem_core.embedding import ReferenceEmbeddingBackend
    from gem_core.model import build_model
    from gem_core.plugins import build_plugins

    source = build_plugins().data_source(DataConfig(max_seq_len=max_seq_len), seed=0)
    torch.manual_seed(0)
    base = build_model(ModelConfig(embedding_dim=dim, num_layers=layers), source.schema,
                       attention=PaddedAttention(),
                       embedding_backend=ReferenceEmbeddingBackend())
    batch = source.generate(batch_size, split=0, index=0)
    tasks = source.schema.tasks
    results: dict[str, Any] = {}
    models: dict[str, nn.Module] = {}
    for policy in POLICIES:
        models[policy] = apply_policy(base, policy)
        results[policy] = {
            "saved_activation_bytes": saved_activation_bytes(models[policy], batch, tasks),
            "train_flops": train_flops(models[policy], batch, tasks),
        }
    for budget in budgets:
        name = f"budget-{budget}"
        models[name], results[name] = compiled_budget(base, budget, batch, tasks)
    from gem_core.compile import CompileTracker

    with CompileTracker() as tracker:
        for name, seconds in step_times_s(models, batch, tasks, repeats).items():
            results[name]["step_time_s"] = seconds
    none = results["none"]
    for entry in results.values():
        entry["activation_ratio_vs_none"] = entry["saved_activation_bytes"] / \
            none["saved_activation_bytes"]
        entry["step_time_ratio_vs_none"] = entry["step_time_s"] / none["step_time_s"]
        if entry["train_flops"] is None:
            entry["recompute_flops"] = entry["recompute_flops_fraction"] = None
            continue
        entry["recompute_flops"] = entry["train_flops"] - none["train_flops"]
        entry["recompute_flops_fraction"] = entry["recompute_flops"] / none["train_flops"]
    return {
        "benchmark": "activation checkpointing memory",
        "device": "cpu",
        "memory_measure": "bytes of distinct storages autograd saves for the backward",
        "flops_measure": "torch.utils.flop_counter over forward + backward (matmul-class ops)",
        "attention_backend": "padded",
        "step_time_measure": f"median of {repeats} forward+backward per policy, the policies "
                             "taking turns step by step, after their first steps",
        **({"compile_s_while_timing": tracker.seconds} if budgets else {}),
        **({"inductor_cache_dir": inductor_cache_in_use()} if budgets else {}),
        "shape": {"batch_size": batch_size, "max_seq_len": max_seq_len, "layers": layers,
                  "embedding_dim": dim, "tokens": int(batch.num_events)},
        "policies": results,
    }


@click.command(name="memory")
@click.option("--batch-size", default=32, show_default=True)
@click.option("--max-seq-len", default=256, show_default=True)
@click.option("--layers", default=2, show_default=True)
@click.option("--dim", default=32, show_default=True, help="embedding_dim")
@click.option("--repeats", default=3, show_default=True, help="timed steps per policy (median)")
@click.option("--budgets", default="1.0,0.5,0.2", show_default=True,
              help="activation memory budgets of the compiled 'budget' rows, comma-separated "
                   "in (0, 1]; empty: no compiled rows")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def memory(batch_size: int, max_seq_len: int, layers: int, dim: int, repeats: int,
           budgets: str, as_json: bool) -> None:
    """Activation memory, recompute FLOPs and step time with and without activation
    checkpointing, and with the compiler's activation memory budgets (compiled blocks)."""
    report = measure(batch_size=batch_size, max_seq_len=max_seq_len, layers=layers, dim=dim,
                     repeats=repeats, budgets=parse_budgets(budgets))
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    for policy, entry in report["policies"].items():
        flops = ("not counted" if entry["recompute_flops_fraction"] is None
                 else f"{entry['recompute_flops_fraction']:+.1%} FLOPs")
        compiled = f", compile {entry['compile_s']:.1f} s" if "compile_s" in entry else ""
        click.echo(f"{policy:>24}: saved {entry['saved_activation_bytes'] / 2**20:8.2f} MiB "
                   f"({entry['activation_ratio_vs_none']:.2f}x), recompute {flops}, "
                   f"step {entry['step_time_s'] * 1e3:.1f} ms{compiled}")


def parse_budgets(text: str) -> list[float]:
    """``"1.0,0.5"`` -> ``[1.0, 0.5]``; each in (0, 1], named when not."""
    budgets = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            value = float(item)
        except ValueError:
            raise click.BadParameter(f"{item!r} is not a number",
                                     param_hint="--budgets") from None
        if not 0 < value <= 1:
            raise click.BadParameter(f"{item} is not in (0, 1]", param_hint="--budgets")
        budgets.append(value)
    return budgets
