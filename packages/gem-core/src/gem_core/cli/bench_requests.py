"""``gem bench requests``: training throughput of the same impressions grouped K per request.

Registered as ``bench.requests``. The synthetic source generates requests of K candidates each;
the peer is the very same impressions as K = 1 data (every impression a request of its own,
with a copy of its history: what a one-candidate-per-row log holds). Both are timed on the same
model (a training step: forward, backward, optimizer), interleaved, and the report gives
impressions/s of each, their ratio, and the FLOPs per impression counted from the real lengths.
"""

from __future__ import annotations

import json
import statistics
import time

import attrs
import click
import torch

from gem_core.batch import JaggedBatch
from gem_core.cli.options import config_options
from gem_core.config import load_config
from gem_core.model import build_model
from gem_core.plugins import build_plugins
from gem_core.registry import AutoContext
from gem_core.train.loss import task_loss_sums


def one_candidate_per_request(batch: JaggedBatch) -> JaggedBatch:
    """The impressions of ``batch``, each in a request of its own with a copy of its history."""
    exploded = batch.select(batch.candidate_rows())
    return attrs.evolve(exploded, candidate_offsets=torch.arange(batch.num_candidates + 1),
                        candidate_ids=batch.candidate_ids, labels=batch.labels,
                        candidate_dense=batch.candidate_dense,
                        candidate_numeric=batch.candidate_numeric)


def _step_time(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: JaggedBatch,
               tasks: tuple[str, ...]) -> float:
    started = time.perf_counter()
    loss = task_loss_sums(model(batch), batch, tasks).sum() / batch.num_candidates
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return time.perf_counter() - started


def requests_report(preset: str, candidates: int, impressions: int, repeats: int,
                    seed: int = 0) -> dict:
    """Median training-step time of ``impressions`` impressions as ``candidates`` per request and
    as one per request, interleaved ``repeats`` times, on ``preset``'s model and backends."""
    config = load_config(preset=preset)
    plugins = build_plugins()
    context = AutoContext(device="cpu")
    attention = plugins.resolve("attention", config.backends.attention, context)
    norm = plugins.resolve("norm", config.backends.norm, context)
    embedding = plugins.resolve("embedding", config.backends.embedding, context)
    data = attrs.evolve(config.data, options={**config.data.options,
                                              "candidates_per_request": candidates})
    source = plugins.data_source(data, seed=seed)
    grouped = source.generate(impressions // candidates, split=1, index=0)
    single = one_candidate_per_request(grouped)
    torch.manual_seed(seed)
    model = build_model(config.model, source.schema, attention=attention.impl,
                        embedding_backend=embedding.impl, norm=norm.impl)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tasks = source.schema.tasks
    times: dict[str, list[float]] = {"grouped": [], "single": []}
    for _name, batch in (("grouped", grouped), ("single", single)):  # warm-up, untimed
        _step_time(model, optimizer, batch, tasks)
    for _ in range(repeats):
        for name, batch in (("grouped", grouped), ("single", single)):
            times[name].append(_step_time(model, optimizer, batch, tasks))
    n = grouped.num_candidates
    out = {"preset": preset, "attention": attention.spec.name, "impressions": n,
           "repeats": repeats, "threads": torch.get_num_threads()}
    for name, batch in (("grouped", grouped), ("single", single)):
        median = statistics.median(times[name])
        flops = model.flops(batch.seq_lengths(), batch.candidate_counts())["total"]
        k = candidates if name == "grouped" else 1
        out[f"k{k}"] = {"requests": batch.batch_size, "history_tokens": batch.num_events,
                        "step_time_s_median": median, "impressions_per_s": n / median,
                        "requests_per_s": batch.batch_size / median,
                        "train_flops_per_impression": flops / n}
    out["impressions_per_s_ratio"] = (out[f"k{candidates}"]["impressions_per_s"]
                                      / out["k1"]["impressions_per_s"])
    out["flops_per_impression_ratio"] = (out["k1"]["train_flops_per_impression"]
                                         / out[f"k{candidates}"]["train_flops_per_impression"])
    return out


@click.command("requests")
@config_options(preset="tiny", preset_help="Model and data preset", config_file=False,
                overrides=False)
@click.option("--candidates", default=16, show_default=True,
              help="Candidates per request of the grouped layout (the peer has 1).")
@click.option("--impressions", default=1024, show_default=True,
              help="Impressions per training step, the same in both layouts.")
@click.option("--repeats", default=5, show_default=True, help="Interleaved timed steps each.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_requests(preset: str, candidates: int, impressions: int, repeats: int,
                   as_json: bool) -> None:
    """Impressions/s of a training step with K candidates per request against the same
    impressions one per request (median of interleaved steps), and FLOPs per impression."""
    report = requests_report(preset, candidates, impressions, repeats)
    if as_json:
        click.echo(json.dumps(report))
        return
    for key in ("k1", f"k{candidates}"):
        r = report[key]
        click.echo(f"{key}: {r['impressions_per_s']:.0f} impressions/s, "
                   f"{r['requests_per_s']:.0f} requests/s, "
                   f"{r['train_flops_per_impression'] / 1e6:.2f} MFLOP per impression")
    click.echo(f"impressions/s ratio: {report['impressions_per_s_ratio']:.2f}x; "
               f"FLOPs per impression ratio: {report['flops_per_impression_ratio']:.2f}x")
