"""``gem bench compile``: the training step eager and compiled (``train.compile``), side by side.

Registered as ``bench.compile``. Copies of the configured model (same seed, so the same
weights) train on the same batches of the configured data, interleaved step by step so that
machine load hits each alike: eager on the backend ``auto`` picks for an eager run on this device
(``blocked`` on CPU with gem-kernels installed), eager on ``padded`` (gem-core's backend that
traces whole), compiled on ``padded``, and compiled on the backend ``auto`` picks for a compiled
run (``blocked`` with gem-kernels, through its custom op; the row is left out when that is
``padded``), each compiled row next to the same backend eager. A step is forward, loss, backward
and the AdamW step. A compiled model's first step compiles it (its compile time is counted by
dynamo's compile-event hooks); every row's first step is left out of the timing, the rest are
reported as the median over ``--repeats`` batches. Each compiled row's losses are compared with
its eager twin's on every batch (they differ only by float rounding).
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
from gem_core.cli.options import config_options
from gem_core.compile import (
    CompileTracker,
    compile_model,
    inductor_cache_in_use,
    use_inductor_cache,
)
from gem_core.config import load_config
from gem_core.distributed import ParallelContext
from gem_core.embedding import ReferenceEmbeddingBackend
from gem_core.model import build_model
from gem_core.plugins import build_plugins
from gem_core.registry import AutoContext
from gem_core.train.applied import config_as_source_applies
from gem_core.train.loss import mean_loss
from gem_core.train.optim import make_optimizer
from gem_core.train.table_optimizer import id_bias_arguments


class _Row:
    """One way of running the step: a model, its optimizer, its step times and losses."""

    def __init__(self, model: torch.nn.Module, config) -> None:
        self.model = model
        self.optimizer = make_optimizer(config.train, config.model.embedding_optimizer,
                                        feature_tables=model.embeddings,
                                        **id_bias_arguments(config.model))(model)
        self.times: list[float] = []
        self.losses: list[float] = []
        # Compile seconds and frames compiled during the first step, and during the later ones.
        self.first_compile = {"seconds": 0.0, "frames": 0}
        self.later_compile = {"seconds": 0.0, "frames": 0}

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


def _compiled_against_eager(rows: dict[str, "_Row"], report: dict[str, Any]) -> dict[str, Any]:
    """Per compiled row: speedup over the same backend eager and over the fastest eager row,
    and the largest relative loss difference from its eager twin."""
    median = {name: entry["step_time_s_median"] for name, entry in report.items()}
    fastest = min((name for name in rows if name.startswith("eager-")), key=median.get)
    out = {}
    for name, row in rows.items():
        if not name.startswith("compiled-"):
            continue
        twin = "eager-" + name.removeprefix("compiled-")
        out[name] = {
            "speedup_vs_eager_same_backend": median[twin] / median[name],
            "fastest_eager": fastest,
            "speedup_vs_fastest_eager": median[fastest] / median[name],
            "loss_max_relative_difference_vs_eager": max(
                abs(a - b) / abs(b) for a, b in zip(row.losses, rows[twin].losses))}
    return out


def compile_report(config, batch_size: int, repeats: int) -> dict[str, Any]:
    """Eager (``auto`` backend), eager ``padded``, compiled ``padded`` and compiled (``auto``
    backend of a compiled run) step times of ``repeats`` + 1 batches of ``batch_size`` rows."""
    if config.train.compile_cache:
        use_inductor_cache(Path(config.train.compile_cache))
    plugins = build_plugins()
    source = plugins.data_source(config.data, seed=config.train.seed)
    config = config_as_source_applies(config, source)  # the model a run on this data builds
    batches = iter(source.eval_batches(batch_size=batch_size))
    batches = [next(batches) for _ in range(repeats + 1)]
    tasks = source.schema.tasks
    auto = plugins.resolve("attention", "auto", AutoContext(device="cpu"))
    auto_compiled = plugins.resolve("attention", "auto", AutoContext(device="cpu", compile=True))

    def model(attention) -> torch.nn.Module:
        torch.manual_seed(config.train.seed)
        return build_model(config.model, source.schema, attention=attention,
                           embedding_backend=ReferenceEmbeddingBackend())

    padded = model(PaddedAttention())
    rows = {f"eager-{auto.spec.name}": _Row(model(auto.impl), config),
            "eager-padded": _Row(copy.deepcopy(padded), config)}
    compile_model(padded, ctx=ParallelContext(), config=config)
    rows["compiled-padded"] = _Row(padded, config)
    compiled_name = auto_compiled.spec.name
    if compiled_name != "padded":
        if compiled_name != auto.spec.name:
            rows[f"eager-{compiled_name}"] = _Row(model(auto_compiled.impl), config)
        compiled_auto = model(auto_compiled.impl)
        compile_model(compiled_auto, ctx=ParallelContext(), config=config)
        rows[f"compiled-{compiled_name}"] = _Row(compiled_auto, config)
    with CompileTracker() as tracker:
        for index, batch in enumerate(batches):
            for row in rows.values():
                # The hooks count every compiled model together: each row reads its own step's.
                seconds, frames = tracker.seconds, tracker.frames
                row.step(batch, tasks)
                counts = row.first_compile if index == 0 else row.later_compile
                counts["seconds"] += tracker.seconds - seconds
                counts["frames"] += tracker.frames - frames
    compiled, same_backend = rows["compiled-padded"], rows["eager-padded"]
    report = {name: row.report() for name, row in rows.items()}
    for name, row in rows.items():
        if name.startswith("compiled-"):
            report[name].update({
                "compile_s": row.first_compile["seconds"],
                "frames_compiled": row.first_compile["frames"],
                "compiled_after_first_step": row.later_compile["frames"],
                "compile_s_after_first_step": row.later_compile["seconds"]})
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
        "compiled_auto_attention": auto_compiled.spec.name,
        "rows": report,
        "compiled": _compiled_against_eager(rows, report),
        "speedup_vs_eager_auto": median[f"eager-{auto.spec.name}"] / median["compiled-padded"],
        "speedup_vs_eager_padded": median["eager-padded"] / median["compiled-padded"],
        "loss_max_relative_difference_vs_eager_padded": max(
            abs(a - b) / abs(b) for a, b in zip(compiled.losses, same_backend.losses)),
    }


@click.command("compile")
@config_options(set_help="Override a key, e.g. --set train.compile_mode=max-autotune "
                         "(repeatable).")
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
    for name, entry in report["compiled"].items():
        click.echo(f"{name} is {entry['speedup_vs_eager_same_backend']:.2f}x the same backend "
                   f"eager and {entry['speedup_vs_fastest_eager']:.2f}x the fastest eager row "
                   f"({entry['fastest_eager']}); losses agree to "
                   f"{entry['loss_max_relative_difference_vs_eager']:.1e}")
