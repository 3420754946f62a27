"""``gem bench serve``: what caching the user embedding buys a server, per request of K candidates.

Registered as ``bench.serve``. A multi-stage model of the preset (``downstream_history =
'events'``, PMA user tokens; random weights: speed does not depend on them) is exported as
``gem export-model`` exports it (``torch.export``, the ``padded`` attention backend). For each
K, requests of K candidates are scored two ways, interleaved:

* ``ranker``: the exported ranker on the cached user embedding (computed once per user, outside
  the timing, as the upstream's cache holds it), one call per request of K candidates;
* ``full``: the exported full model with the same request repeated as K one-candidate requests in
  one call (a server without the split scores each (user, candidate) pair as its own row and runs
  the upstream tower for each).

Reported per K: candidates/s (K over the median latency of a request), p50 and p99 latency per
request, and the ranker/full candidates/s ratio.
"""

from __future__ import annotations

import json
import statistics
import time

import attrs
import click
import torch

from gem_core.cli.bench_requests import one_candidate_per_request
from gem_core.cli.options import config_options
from gem_core.config import load_config
from gem_core.model import build_model
from gem_core.plugins import build_plugins
from gem_core.registry import AutoContext
from gem_core.serving.export import EXPORT_ATTENTION, capture
from gem_core.serving.inputs import batch_inputs, input_specs
from gem_core.serving.programs import FULL, RANKER, programs_of

CANDIDATE_COUNTS = (1, 16, 64, 256)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _exported(program, example: dict[str, torch.Tensor]):
    return capture(program, example, input_specs(program.model.schema, program.groups)).module()


def serve_report(preset: str, candidate_counts: tuple[int, ...], requests: int,
                 seed: int = 0, max_history: int | None = None,
                 mean_history: float | None = None) -> dict:
    """Latency and candidates/s of the exported ranker and full model of ``preset`` over
    ``requests`` distinct requests per K (each timed once per pass, interleaved);
    ``max_history``: the data's history cap instead of the preset's; ``mean_history``: the
    generated histories' mean length (the ``mean_length`` option of the preset's synthetic
    source; production histories run to thousands of events)."""
    config = load_config(preset=preset)
    if max_history is not None:
        config = attrs.evolve(config, data=attrs.evolve(config.data, max_seq_len=max_history))
    model_config = attrs.evolve(config.model, downstream_history="events",
                                pma_queries=config.model.pma_queries or 2)
    plugins = build_plugins()
    context = AutoContext(device="cpu")
    attention = plugins.resolve("attention", EXPORT_ATTENTION, context)
    norm = plugins.resolve("norm", config.backends.norm, context)
    embedding = plugins.resolve("embedding", config.backends.embedding, context)
    torch.manual_seed(seed)
    lengths = {} if mean_history is None else {"mean_length": mean_history}
    data = attrs.evolve(config.data, options={**config.data.options, **lengths,
                                              "candidates_per_request": max(candidate_counts)})
    source = plugins.data_source(data, seed=seed)
    model = build_model(model_config, source.schema, attention=attention.impl,
                        embedding_backend=embedding.impl, norm=norm.impl).eval()
    programs = programs_of(model, attention.impl)
    ranker, full = programs[RANKER], programs[FULL]
    # Requests with a history of two events or more: an exported program needs at least one
    # event per call (and a mixture-of-experts model two); a new user's empty history is
    # scored by a server without the tower.
    generated = source.generate(4 * requests, split=1, index=0)
    usable = torch.nonzero(generated.seq_lengths() >= 2).flatten()[:requests]
    if usable.numel() < requests:
        raise click.ClickException(f"the {preset} data gave {usable.numel()} requests with a "
                                   f"history of 2+ events out of {4 * requests}; need {requests}")
    pool = generated.select(usable)
    with torch.no_grad():
        pool = attrs.evolve(pool, user_embedding=model.user_embedding(pool))
    example = pool.select(torch.arange(min(3, requests)))
    compiled = {RANKER: _exported(ranker, batch_inputs(example, ranker.model.schema,
                                                         ranker.groups)),
                FULL: _exported(full, batch_inputs(example, full.model.schema, full.groups))}
    out: dict = {"preset": preset, "max_history": config.data.max_seq_len,
                 "attention": EXPORT_ATTENTION, "threads":
                 torch.get_num_threads(), "requests_per_k": requests,
                 "mean_history_events": pool.num_events / pool.batch_size, "k": {}}
    for k in candidate_counts:
        calls = {RANKER: [], FULL: []}
        for r in range(requests):
            request = pool.select(torch.tensor([r]))
            keep = torch.arange(k)  # the request's first K candidates
            request = attrs.evolve(
                request, candidate_offsets=torch.tensor([0, k]),
                candidate_ids={n: v[keep] for n, v in request.candidate_ids.items()},
                labels={n: v[keep] for n, v in request.labels.items()},
                candidate_dense=(None if request.candidate_dense is None
                                 else request.candidate_dense[keep]))
            calls[RANKER].append(batch_inputs(request, ranker.model.schema, ranker.groups))
            calls[FULL].append(batch_inputs(one_candidate_per_request(request),
                                            full.model.schema, full.groups))
        latencies = {RANKER: [], FULL: []}
        with torch.no_grad():
            for name in (RANKER, FULL):  # warm-up, untimed
                compiled[name](calls[name][0])
            for r in range(requests):
                for name in (RANKER, FULL):
                    started = time.perf_counter()
                    compiled[name](calls[name][r])
                    latencies[name].append(time.perf_counter() - started)
        entry = {}
        for name in (RANKER, FULL):
            median = statistics.median(latencies[name])
            entry[name] = {"latency_ms_p50": 1e3 * median,
                           "latency_ms_p99": 1e3 * _percentile(latencies[name], 0.99),
                           "candidates_per_s": k / median}
        entry["candidates_per_s_ratio"] = (entry[RANKER]["candidates_per_s"]
                                           / entry[FULL]["candidates_per_s"])
        out["k"][str(k)] = entry
    return out


@click.command("serve")
@config_options(preset="tiny-gem", config_file=False, overrides=False,
                preset_help="Model and data preset (made multi-stage: "
                            "downstream_history = 'events')")
@click.option("--candidates", "candidate_counts", multiple=True, type=click.IntRange(min=1),
              default=CANDIDATE_COUNTS, show_default=True,
              help="Candidates per request K (repeatable).")
@click.option("--requests", default=20, show_default=True, type=click.IntRange(min=1),
              help="Distinct requests timed per K (p99 needs many).")
@click.option("--max-history", default=None, type=click.IntRange(min=2),
              help="History cap (data.max_seq_len) instead of the preset's.")
@click.option("--mean-history", default=None, type=click.FloatRange(min=1.0),
              help="Mean generated history length (the synthetic source's mean_length option) "
                   "instead of the preset's.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_serve(preset: str, candidate_counts: tuple[int, ...], requests: int,
                max_history: int | None, mean_history: float | None, as_json: bool) -> None:
    """Candidates/s and latency of the exported ranker on the cached user embedding against the
    full model run once per candidate, for requests of K candidates."""
    report = serve_report(preset, tuple(candidate_counts), requests, max_history=max_history,
                          mean_history=mean_history)
    if as_json:
        click.echo(json.dumps(report))
        return
    for k, entry in report["k"].items():
        click.echo(f"K={k}: ranker {entry[RANKER]['candidates_per_s']:.0f} candidates/s "
                   f"(p50 {entry[RANKER]['latency_ms_p50']:.2f} ms, p99 "
                   f"{entry[RANKER]['latency_ms_p99']:.2f} ms); full per candidate "
                   f"{entry[FULL]['candidates_per_s']:.0f} candidates/s (p50 "
                   f"{entry[FULL]['latency_ms_p50']:.2f} ms); ratio "
                   f"{entry['candidates_per_s_ratio']:.1f}x")
