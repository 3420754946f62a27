"""``gem bench flops``: the model's analytic FLOP count next to torch's FlopCounterMode count.

Registered as ``bench.flops``. Runs one batch of the configured data through the model on CPU
with the reference attention backend (it computes each sample's full query x key rectangle, so
the analytic count is taken the same way: ``dense``), forward and forward + backward, and prints
both per module; the jagged (masked) count the trainer uses for MFU and the padded count are
printed beside them.
"""

from __future__ import annotations

import json
import time

import click
import torch
from torch.utils.flop_counter import FlopCounterMode

from gem_core.attention.reference import ReferenceAttention
from gem_core.cli.options import config_options
from gem_core.config import load_config
from gem_core.embedding import ReferenceEmbeddingBackend
from gem_core.flops import TRAIN_FACTOR
from gem_core.model import build_model
from gem_core.model.summary import parameter_counts
from gem_core.plugins import build_plugins
from gem_core.train.applied import config_as_source_applies


def _counted_by_module(counter: FlopCounterMode, analytic_keys: list[str]) -> dict[str, int]:
    """FlopCounterMode's per-module totals, grouped under the analytic count's module names."""
    by_module = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    grouped = {}
    for key in dict.fromkeys(k.split(".")[0] for k in analytic_keys):
        # The candidate's content vector goes through events.content outside events.forward.
        prefix = "GEMModel.events.content" if key == "events" else f"GEMModel.{key}"
        if prefix in by_module:
            grouped[key] = by_module[prefix]
        else:  # a ModuleDict (heads) is never called itself: add up its children
            grouped[key] = sum(v for name, v in by_module.items()
                               if name.startswith(prefix + ".") and name.count(".") == 2)
    return grouped


def _grouped(analytic: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for key, value in analytic.items():
        out[key.split(".")[0]] = out.get(key.split(".")[0], 0) + value
    return out


def flops_report(config, batch_size: int, seed: int) -> dict:
    """Analytic and counted FLOPs of one batch of ``batch_size`` samples of the configured data."""
    source = build_plugins().data_source(config.data, seed=seed)
    config = config_as_source_applies(config, source)  # the model a run on this data builds
    batch = next(iter(source.eval_batches(batch_size=batch_size)))
    torch.manual_seed(seed)
    model = build_model(config.model, source.schema, attention=ReferenceAttention(),
                        embedding_backend=ReferenceEmbeddingBackend())
    lengths = batch.seq_lengths()
    analytic_dense = model.flops_by_module(lengths, batch.candidate_counts(), dense=True)
    started = time.perf_counter()
    with FlopCounterMode(display=False) as forward_counter:
        out = model(batch)
    with FlopCounterMode(display=False) as backward_counter:
        sum(logit.sum() for logit in out.values()).backward()
    seconds = time.perf_counter() - started
    counted_forward = forward_counter.get_total_flops()
    counted_train = counted_forward + backward_counter.get_total_flops()
    analytic_forward = sum(analytic_dense.values())
    trainer = model.flops(lengths, batch.candidate_counts())
    return {
        "benchmark": "flops",
        "preset": config.name,
        "batch_size": batch.batch_size,
        "history_events": int(lengths.sum()),
        "max_history": int(lengths.max()) if lengths.numel() else 0,
        "parameters": parameter_counts(model),
        "attention_backend": "reference (full per-sample rectangles: counted as dense)",
        "counted": "torch.utils.flop_counter.FlopCounterMode: matmuls only",
        "forward": {
            "analytic": analytic_forward,
            "counted": counted_forward,
            "analytic_over_counted": (analytic_forward / counted_forward
                                      if counted_forward else None),
        },
        "forward_backward": {
            "analytic": TRAIN_FACTOR * analytic_forward,
            "counted": counted_train,
            "analytic_over_counted": (TRAIN_FACTOR * analytic_forward / counted_train
                                      if counted_train else None),
        },
        "forward_by_module": {
            "analytic": _grouped(analytic_dense),
            "counted": _counted_by_module(forward_counter, list(analytic_dense)),
        },
        "trainer_counts": {
            "jagged_train_flops": trainer["total"],
            "jagged_attention_train_flops": trainer["attention"],
            "padded_train_flops": trainer["padded_total"],
            "padded_over_jagged": (trainer["padded_total"] / trainer["total"]
                                   if trainer["total"] else None),
            "forward_by_module_jagged": model.flops_by_module(lengths, batch.candidate_counts()),
        },
        "wall_s": round(seconds, 3),
    }


@click.command("flops")
@config_options(set_help="Override a key, e.g. --set model.pma_queries=4 (repeatable).")
@click.option("--batch-size", type=int, default=16, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def bench_flops(preset, config_file, overrides, batch_size, seed, as_json) -> None:
    """Analytic FLOPs of the configured model next to FlopCounterMode's count, per module."""
    config = load_config(preset=preset, path=config_file, overrides=overrides)
    report = flops_report(config, batch_size, seed)
    if as_json:
        click.echo(json.dumps(report))
        return
    for phase in ("forward", "forward_backward"):
        r = report[phase]
        click.echo(f"{phase:17s} analytic {r['analytic']:.4g}  counted {r['counted']:.4g}  "
                   f"ratio {r['analytic_over_counted']:.4f}")
    by_module = report["forward_by_module"]
    for name, value in by_module["analytic"].items():
        click.echo(f"  {name:18s} analytic {value:.4g}  counted {by_module['counted'][name]:.4g}")
    t = report["trainer_counts"]
    click.echo(f"jagged training FLOPs {t['jagged_train_flops']:.4g}, padded "
               f"{t['padded_train_flops']:.4g} ({t['padded_over_jagged']:.2f}x)")


if __name__ == "__main__":  # ``python -m gem_core.cli.bench_flops`` before it is registered
    bench_flops()
