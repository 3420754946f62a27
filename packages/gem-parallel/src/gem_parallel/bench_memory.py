"""``gem bench memory``: activation memory and recompute FLOPs of each checkpointing policy.

On CPU there is no allocator peak to read, so memory is what autograd keeps for the backward:
the bytes of the distinct storages packed by ``saved_tensors_hooks`` during one forward (inside a
checkpointed region torch.utils.checkpoint installs its own hooks and keeps only the region's
inputs, so those activations are not counted: exactly the memory it saves). FLOPs come from
``torch.utils.flop_counter`` over forward + backward; the difference to no checkpointing is the
recomputation.
"""

from __future__ import annotations

import copy
import json
import time
from typing import Any, Sequence

import click
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

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


def step_time_s(model: nn.Module, batch, tasks: Sequence[str], repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        mean_loss(model(batch), batch, tasks).backward()
        times.append(time.perf_counter() - started)
        model.zero_grad(set_to_none=True)
    times = times[1:]  # the first step pays one-off costs (allocator growth, lazy init)
    return sorted(times)[len(times) // 2]


def apply_policy(model: nn.Module, policy: str) -> nn.Module:
    from gem_parallel.checkpointing import FullCheckpointing, SelectiveCheckpointing

    model = copy.deepcopy(model)
    if policy == "none":
        return model
    impl = FullCheckpointing() if policy == "full" else SelectiveCheckpointing()
    return impl.apply(model, ctx=ParallelContext(), options=POLICIES[policy])


def measure(*, batch_size: int, max_seq_len: int, layers: int, dim: int,
            repeats: int) -> dict[str, Any]:
    from gem_core.attention.reference import ReferenceAttention
    from gem_core.config import DataConfig, ModelConfig
    from gem_core.data.synthetic import SyntheticSource
    from gem_core.embedding import ReferenceEmbeddingBackend
    from gem_core.model import build_model

    source = SyntheticSource(DataConfig(max_seq_len=max_seq_len), seed=0)
    torch.manual_seed(0)
    base = build_model(ModelConfig(embedding_dim=dim, num_layers=layers), source.schema,
                       attention=ReferenceAttention(),
                       embedding_backend=ReferenceEmbeddingBackend())
    batch = source.generate(batch_size, split=0, index=0)
    tasks = source.schema.tasks
    results: dict[str, Any] = {}
    for policy in POLICIES:
        model = apply_policy(base, policy)
        results[policy] = {
            "saved_activation_bytes": saved_activation_bytes(model, batch, tasks),
            "train_flops": train_flops(model, batch, tasks),
            "step_time_s": step_time_s(model, batch, tasks, repeats),
        }
    none = results["none"]
    for entry in results.values():
        entry["activation_ratio_vs_none"] = entry["saved_activation_bytes"] / \
            none["saved_activation_bytes"]
        entry["recompute_flops"] = entry["train_flops"] - none["train_flops"]
        entry["recompute_flops_fraction"] = entry["recompute_flops"] / none["train_flops"]
    return {
        "benchmark": "activation checkpointing memory",
        "device": "cpu",
        "memory_measure": "bytes of distinct storages autograd saves for the backward",
        "flops_measure": "torch.utils.flop_counter over forward + backward (matmul-class ops)",
        "attention_backend": "reference",
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
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def memory(batch_size: int, max_seq_len: int, layers: int, dim: int, repeats: int,
           as_json: bool) -> None:
    """Activation memory and recompute FLOPs with and without activation checkpointing."""
    report = measure(batch_size=batch_size, max_seq_len=max_seq_len, layers=layers, dim=dim,
                     repeats=repeats)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    for policy, entry in report["policies"].items():
        click.echo(f"{policy:>24}: saved {entry['saved_activation_bytes'] / 2**20:8.2f} MiB "
                   f"({entry['activation_ratio_vs_none']:.2f}x), recompute "
                   f"{entry['recompute_flops_fraction']:+.1%} FLOPs, "
                   f"step {entry['step_time_s'] * 1e3:.1f} ms")
