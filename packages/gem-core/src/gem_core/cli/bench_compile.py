"""``gem bench compile``: the training step eager and compiled (``train.compile``), side by side.

Registered as ``bench.compile``. Three copies of the configured model (same seed, so the same
weights) train on the same batches of the configured data, interleaved step by step so that
machine load hits each alike: eager on the backend ``auto`` picks for an eager run on this device
(``blocked`` on CPU with gem-kernels installed), eager on ``padded`` (the backend a compiled CPU
run uses, so the pair isolates the compiler), and compiled on ``padded``. A step is forward, loss,
backward and the AdamW step. The compiled model's first step compiles it (its compile time is
counted by dynamo's compile-event hooks); every row's first step is left out of the timing, the
rest are reported as the median over ``--repeats`` batches. The compiled and eager ``padded``
losses are compared on every batch (they differ only by float rounding).
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from pathlib import Path
from typing import Any

import click
import torch

from gem_core.attention.padded import PaddedAttention
from gem_core.compile import (CompileTracker, compile_model, inductor_cache_in_use,
                              use_inductor_cache)
from gem_core.config import load_config
from gem_core.distributed import ParallelContext
from gem_core.embedding import ReferenceEmbeddingBackend
from gem_core.model import build_model
from gem_core.plugins import build_plugins
from gem_core.registry import AutoContext
from gem_core.train.loss import mean_loss
from gem_core.train.optim import make_adamw


class _Row:
    """One way of running the step: a model, its optimizer, its step times and losses."""

    def __init__(self, model: torch.nn.Module, config) -> None:
        self.model = model
        self.optimizer = make_adamw(config.train)(model)
        self.times: list[float] = []
        self.losses: list[float] = []

    def step(self, batch, tasks) -> float:
        started = time.perf_counter()
        loss = mean_loss(self.model(batch), batch, tasks)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - started
        self.times.append(elapsed)
        self.losses.append(float(loss.detach()))
        return elapsed

    def report(self) -> dict[str, Any]:
        timed = self.times[1:]
        return {"step_time_s_median": statistics.median(timed), "first_step_s": self.times[0],
                "step_times_s": timed}


def compile_report(config, batch_size: int, repeats: int) -> dict[str, Any]:
    """Eager (``auto`` backend), eager ``padded`` and compiled ``padded`` step times of
    ``repeats`` + 1 batches of ``batch_size`` rows."""
    if config.train.compile_cache:
        use_inductor_cache(Path(config.train.compile_cache))
    plugins = build_plugins()
    source = plugins.registry("data").load(config.data.source)(config.data, seed=config.train.seed)
    batches = iter(source.eval_batches(batch_size=batch_size))
    batches = [next(batches) for _ in range(repeats + 1)]
    tasks = source.schema.tasks
    auto = plugins.resolve("attention", "auto", AutoContext(device="cpu"))

    def model(attention) -> torch.nn.Module:
        torch.manual_seed(config.train.seed)
        return build_model(config.model, source.schema, attention=attention,
                           embedding_backend=ReferenceEmbeddingBackend())

    padded = model(PaddedAttention())
    rows = {f"eager-{auto.spec.name}": _Row(model(auto.impl), config),
            "eager-padded": _Row(copy.deepcopy(padded), config)}
    compile_model(padded, ctx=ParallelContext(), config=config)
    rows["compiled-padded"] = _Row(padded, config)
    with CompileTracker() as tracker:
        for index, batch in enumerate(batches):
            for row in rows.values():
                row.step(batch, tasks)
            if index == 0:
                first_compile_s, first_frames = tracker.seconds, tracker.frames
    compiled, same_backend = rows["compiled-padded"], rows["eager-padded"]
    report = {name: row.report() for name, row in rows.items()}
    report["compiled-padded"].update({
        "compile_s": first_compile_s,
        "frames_compiled": first_frames,
        "compiled_after_first_step": tracker.frames - first_frames,
        "compile_s_after_first_step": tracker.seconds - first_compile_s})
    median = {name: entry["step_time_s_median"] for name, entry in report.items()}
    tokens = [int(batch.num_events) for batch in batches[1:]]
    return {
        "benchmark": "training step eager vs compiled (forward, loss, backward, AdamW)",
        "config": config.name, "batch_size": batch_size, "repeats": repeats,
        "tokens_per_batch": {"min": min(tokens), "median": statistics.median(tokens),
                             "max": max(tokens)},
        "threads": torch.get_num_threads(), "compile_mode": config.train.compile_mode,
        "inductor_cache_dir": inductor_cache_in_use(),
        "eager_auto_attention": auto.spec.name,
        "rows": report,
        "speedup_vs_eager_auto": median[f"eager-{auto.spec.name}"] / median["compiled-padded"],
        "speedup_vs_eager_padded": median["eager-padded"] / median["compiled-padded"],
        "loss_max_relative_difference_vs_eager_padded": max(
            abs(a - b) / abs(b) for a, b in zip(compiled.losses, same_backend.losses)),
    }


@click.command("compile")
@click.option("--preset", default=None, help="Preset name (default: tiny).")
@click.option("--config", "config_file", default=None, type=click.Path(dir_okay=False),
              help="A TOML config instead of a preset.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config value (repeatable), e.g. train.compile_mode=max-autotune.")
@click.option("--batch-size", type=int, default=None,
              help="Rows per step (default: the config's train.batch_size).")
@click.option("--repeats", type=int, default=10, show_default=True,
              help="timed steps per row (median), after one untimed first step")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def bench_compile(preset, config_file, overrides, batch_size, repeats, as_json) -> None:
    """Training step time eager vs compiled (train.compile), and the compile time."""
    if repeats < 1:
        raise click.BadParameter("must be at least 1", param_hint="--repeats")
    config = load_config(preset=preset, path=config_file, overrides=overrides)
    report = compile_report(config, batch_size or config.train.batch_size, repeats)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    for name, entry in report["rows"].items():
        extra = (f", compile {entry['compile_s']:.1f} s" if "compile_s" in entry else "")
        click.echo(f"{name:>16}: median step {entry['step_time_s_median'] * 1e3:8.1f} ms, first "
                   f"step {entry['first_step_s']:.2f} s{extra}")
    click.echo(f"compiled is {report['speedup_vs_eager_auto']:.2f}x eager "
               f"{report['eager_auto_attention']} and {report['speedup_vs_eager_padded']:.2f}x "
               f"eager padded; losses agree to {report['loss_max_relative_difference_vs_eager_padded']:.1e}")
