"""``gem export-user-embeddings``: the upstream tower's output, joined to the data as a column.

Multi-stage GEM training runs the deep upstream user model on its own schedule and hands the
downstream ranker one user embedding per request (shared by the request's candidates): the
ranker never runs the tower. This
command does that hand-off for a trained run. It loads the run's latest checkpoint, runs the
upstream (tower + PMA) alone over the train and eval splits of the run's data, and writes a
Parquet data set (``gem_data`` format 2, one row per request) holding every original column plus
``user_embedding``:
what a feature-store join would give the ranker. Train a ranker on it with
``model.user_embeddings = 'cached'`` and ``--data parquet --set data.path=OUT``.

Staleness: a production upstream runs ahead of the ranker, so the embedding a request sees was
computed some time earlier, from an older history. ``--staleness S`` computes each embedding from
the history events at least ``S`` seconds older than the request (the ranker itself still sees
the fresh history). ``export.json`` reports the eval NE of the run's model with the live
upstream and with the exported embeddings, so users see what staleness costs; at ``S = 0`` the
two are equal (a test checks it to the last bit).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from pathlib import Path
from typing import Any, Iterator

import attrs
import click
import torch

from gem_core.batch import JaggedBatch
from gem_core.config import GemConfig
from gem_core.data.api import contiguous_balancer
from gem_core.errors import GemConfigError
from gem_core.metrics import task_report
from gem_core.model.gem import GEMModel
from gem_core.serving.programs import ranker_model
from gem_core.trained_run import load_run
from gem_data.batch_ops import events_before
from gem_data.writer import DatasetWriter

log = logging.getLogger(__name__)


def load_trained_model(run_dir: Path, step: int | None = None
                       ) -> tuple[GemConfig, Any, GEMModel, Any, int]:
    """The run's config, data source, model with the weights of its best checkpoint (or
    ``step``'s), the
    attention backend and the checkpoint's step (through :func:`gem_core.trained_run.load_run`)."""
    def check(config: GemConfig) -> None:
        m = config.model
        if m.user_embeddings != "live" or m.downstream_history != "events" or not m.pma_queries:
            raise GemConfigError(
                f"{run_dir} was trained with model.user_embeddings = {m.user_embeddings!r}, "
                f"downstream_history = {m.downstream_history!r}, pma_queries = {m.pma_queries}; "
                "exporting needs a live upstream whose only output to the ranker is its PMA user "
                "tokens: user_embeddings = 'live', downstream_history = 'events', pma_queries > 0")

    run = load_run(run_dir, step=step, check_config=check)
    log.info("checkpoint step %d: %s", run.step, run.choice.reason)
    return run.config, run.source, run.model, run.backends.attention.impl, run.step


def with_user_embeddings(model: GEMModel, batch: JaggedBatch, staleness_s: int) -> JaggedBatch:
    """``batch`` (fresh history) plus the upstream embedding of each request, computed from the
    events at least ``staleness_s`` older than the request (every event feature cut alike)."""
    upstream_view = (events_before(batch, batch.request_timestamps - staleness_s)
                     if staleness_s else batch)
    with torch.no_grad():
        embedding = model.user_embedding(upstream_view).float()
    return attrs.evolve(batch, user_embedding=embedding.contiguous())


def _train_batches(source: Any, batch_size: int, rows: int) -> Iterator[JaggedBatch]:
    """The first ``rows`` rows of the training stream (as one rank sees it), in order."""
    stream = source.train_stream(batch_size=batch_size, rank=0, world_size=1,
                                 balancer=contiguous_balancer,
                                 cost_fn=lambda b: [1.0] * b.batch_size)
    for index, batch in enumerate(itertools.islice(stream, math.ceil(rows / batch_size))):
        left = rows - index * batch_size
        yield batch if left >= batch.batch_size else batch.select(torch.arange(left))


def _ne(report: dict[str, dict[str, float]]) -> dict[str, float]:
    return {task: values["ne"] for task, values in report.items()}


def export(run_dir: Path, out: Path, *, train_rows: int, staleness_s: int,
           batch_size: int, step: int | None = None) -> dict[str, Any]:
    config, source, model, attention, step = load_trained_model(run_dir, step)
    tasks = source.schema.tasks
    width = config.model.pma_queries * config.model.embedding_dim
    schema = attrs.evolve(source.schema, user_embedding_dim=width)
    ranker = ranker_model(model, attention)
    writer = DatasetWriter(out, schema, info={
        "exported_from": str(run_dir), "checkpoint_step": step, "staleness_s": staleness_s})
    live: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {t: [] for t in tasks}
    cached: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {t: [] for t in tasks}
    rows = {"train": 0, "eval": 0}
    for batch in _train_batches(source, batch_size, train_rows):
        writer.write("train", with_user_embeddings(model, batch, staleness_s))
        rows["train"] += batch.batch_size
    for batch in source.eval_batches(batch_size=batch_size):
        exported = with_user_embeddings(model, batch, staleness_s)
        writer.write("eval", exported)
        rows["eval"] += batch.batch_size
        with torch.no_grad():
            fresh, from_cache = model(batch), ranker(exported)
        for task in tasks:
            live[task].append((fresh[task], batch.labels[task]))
            cached[task].append((from_cache[task], batch.labels[task]))
    writer.close()

    def report(parts: dict[str, list[tuple[torch.Tensor, torch.Tensor]]]) -> dict[str, Any]:
        return {t: task_report(torch.cat([p for p, _ in parts[t]]),
                               torch.cat([y for _, y in parts[t]])) for t in tasks}

    live_report, cached_report = report(live), report(cached)
    summary = {
        "run": str(run_dir), "checkpoint_step": step, "out": str(out),
        "staleness_s": staleness_s, "rows": rows, "user_embedding_dim": width,
        "eval_ne": {"live_upstream": _ne(live_report), "cached_upstream": _ne(cached_report)},
        "eval": {"live_upstream": live_report, "cached_upstream": cached_report},
    }
    (out / "export.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


@click.command(name="export-user-embeddings")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Directory of the Parquet data set to write.")
@click.option("--train-rows", default=16384, show_default=True, type=click.IntRange(min=1),
              help="Rows of the train split to export (the eval split is exported whole).")
@click.option("--staleness", "staleness_s", default=0, show_default=True,
              type=click.IntRange(min=0),
              help="Seconds: each embedding sees only history events this much older than "
                   "its request.")
@click.option("--batch-size", default=512, show_default=True, type=click.IntRange(min=1))
@click.option("--step", default=None, type=click.IntRange(min=0),
              help="Checkpoint step to use (default: the best complete checkpoint, by "
                   "evaluation NE; the newest when none has one).")
def export_user_embeddings(run_dir: Path, out: Path, train_rows: int, staleness_s: int,
                           batch_size: int, step: int | None) -> None:
    """Run a trained run's upstream tower over its data; write the data plus user embeddings."""
    from gem_core.trained_run import choose_checkpoint

    choice = choose_checkpoint(run_dir, step)
    click.echo(f"checkpoint step {choice.step}: {choice.reason}")
    summary = export(run_dir, out, train_rows=train_rows, staleness_s=staleness_s,
                     batch_size=batch_size, step=choice.step)
    click.echo(f"wrote {summary['rows']['train']} train and {summary['rows']['eval']} eval rows "
               f"with {summary['user_embedding_dim']}-float user embeddings to {out}")
    for task in summary["eval_ne"]["live_upstream"]:
        click.echo(f"  {task}: eval NE {summary['eval_ne']['live_upstream'][task]:.4f} live "
                   f"upstream, {summary['eval_ne']['cached_upstream'][task]:.4f} from the "
                   f"export (staleness {staleness_s} s)")
