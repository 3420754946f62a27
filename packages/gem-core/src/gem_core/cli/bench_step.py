"""``gem bench step``: the training step of a configuration against a peer configuration, side by
side on the same batches.

Registered as ``bench.step``. The configured model (``--preset``/``--config`` and ``--set``) is
the subject; the peer is the same configuration with the ``--against KEY=VALUE`` overrides on
top (``--against model.attribute_attention_latest=0`` asks what the latest-match heads cost).
Both train on the same batches of the configured data, eager, on the attention backend ``auto``
picks for an eager run on this device, with their own AdamW. A step is forward, loss, backward
and the optimizer step.

These machines are noisy, so the two are measured side by side: in each of ``--rounds`` rounds
both models take ``--repeats`` steps, interleaved step by step, the one going first alternating
from step to step, so that load on the machine hits both alike. The first step of each model
(allocation, first-touch) is left out. Each round gives the ratio of the medians (subject over
peer); the report's ratio is the median of the rounds' ratios, with every round's figures
beside it. The trainer's analytic training FLOPs of each model on the timed batches are
reported too, so a time ratio can be read against a FLOP ratio.

The peer must train on the same data: ``--against`` keys under ``data.`` or
``train.batch_size`` are refused.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any, Sequence

import click
import torch

from gem_core.cli.options import config_options
from gem_core.config import load_config
from gem_core.embedding import ReferenceEmbeddingBackend
from gem_core.model import build_model
from gem_core.plugins import build_plugins
from gem_core.registry import AutoContext
from gem_core.train.applied import config_as_source_applies
from gem_core.train.loss import mean_loss
from gem_core.train.optim import make_optimizer
from gem_core.train.table_optimizer import id_bias_arguments

DATA_KEYS = ("data.", "train.batch_size")
"""Override keys that would give the peer other batches than the subject (refused)."""


def check_against(against: Sequence[str]) -> None:
    """Refuses peer overrides that change the data (the comparison would not be side by side)."""
    for pair in against:
        key, sep, _ = pair.partition("=")
        if not sep:
            raise click.BadParameter(f"{pair!r}: expected KEY=VALUE", param_hint="--against")
        if key.strip().startswith(DATA_KEYS):
            raise click.BadParameter(
                f"{key.strip()!r} changes the data; the peer must train on the subject's "
                "batches (set it with --set for both)", param_hint="--against")


class _Trainee:
    """One model, its optimizer and its step times."""

    def __init__(self, config, schema, attention) -> None:
        torch.manual_seed(config.train.seed)
        self.model = build_model(config.model, schema, attention=attention,
                                 embedding_backend=ReferenceEmbeddingBackend())
        self.optimizer = make_optimizer(config.train, config.model.embedding_optimizer,
                                        feature_tables=self.model.embeddings,
                                        **id_bias_arguments(config.model))(self.model)
        self.times: list[float] = []

    def step(self, batch, tasks) -> None:
        started = time.perf_counter()
        loss = mean_loss(self.model(batch), batch, tasks)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.times.append(time.perf_counter() - started)

    def train_flops(self, batches) -> float:
        """The trainer's analytic training FLOPs per step (jagged), averaged over ``batches``."""
        return statistics.fmean(
            float(self.model.flops(b.seq_lengths(), b.candidate_counts())["total"])
            for b in batches)


def step_report(subject_config, peer_config, *, batch_size: int, repeats: int,
                rounds: int) -> dict[str, Any]:
    """Median step times of the subject and the peer configuration, measured side by side."""
    plugins = build_plugins()
    source = plugins.data_source(subject_config.data, seed=subject_config.train.seed)
    # Both models as a run on this data builds them (the peer differs in model keys only, so
    # the subject's source is the peer's too).
    subject_config = config_as_source_applies(subject_config, source)
    peer_config = config_as_source_applies(peer_config, source)
    batches = iter(source.eval_batches(batch_size=batch_size))
    batches = [next(batches) for _ in range(repeats + 1)]
    tasks = source.schema.tasks
    attention = plugins.resolve("attention", "auto", AutoContext(device="cpu"))
    subject = _Trainee(subject_config, source.schema, attention.impl)
    peer = _Trainee(peer_config, source.schema, attention.impl)
    per_round = []
    for _ in range(rounds):
        subject.times.clear()
        peer.times.clear()
        for index, batch in enumerate(batches):
            order = (subject, peer) if index % 2 == 0 else (peer, subject)
            for trainee in order:
                trainee.step(batch, tasks)
        subject_median = statistics.median(subject.times[1:])
        peer_median = statistics.median(peer.times[1:])
        per_round.append({"subject_step_s": subject_median, "peer_step_s": peer_median,
                          "ratio": subject_median / peer_median})
    subject_flops = subject.train_flops(batches[1:])
    peer_flops = peer.train_flops(batches[1:])
    return {
        "benchmark": "training step, subject against peer (forward, loss, backward, AdamW)",
        "config": subject_config.name, "batch_size": batch_size, "repeats": repeats,
        "rounds": rounds, "threads": torch.get_num_threads(),
        "attention_backend": attention.spec.name,
        "subject_step_s_median": statistics.median(r["subject_step_s"] for r in per_round),
        "peer_step_s_median": statistics.median(r["peer_step_s"] for r in per_round),
        "time_ratio_median": statistics.median(r["ratio"] for r in per_round),
        "rounds_detail": per_round,
        "subject_train_flops": subject_flops,
        "peer_train_flops": peer_flops,
        "flop_ratio": subject_flops / peer_flops,
    }


@click.command("step")
@config_options(set_help="Override a key of both models, e.g. --set data.max_seq_len=64 "
                         "(repeatable).")
@click.option("--against", multiple=True, metavar="KEY=VALUE", required=True,
              help="An override that makes the peer out of the configured model, e.g. "
                   "--against model.target_match=0 (repeatable; not data keys).")
@click.option("--batch-size", type=int, default=None,
              help="Rows per step (default: the config's train.batch_size).")
@click.option("--repeats", type=int, default=10, show_default=True,
              help="timed steps of each model per round, after one untimed first step")
@click.option("--rounds", type=int, default=3, show_default=True,
              help="rounds; the ratio reported is the median of the rounds' ratios")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def bench_step(preset, config_file, overrides, against, batch_size, repeats, rounds,
               as_json) -> None:
    """Training step time of the configured model against a peer configuration, side by side."""
    if repeats < 1:
        raise click.BadParameter("must be at least 1", param_hint="--repeats")
    if rounds < 1:
        raise click.BadParameter("must be at least 1", param_hint="--rounds")
    check_against(against)
    subject = load_config(preset=preset, path=config_file, overrides=overrides)
    peer = load_config(preset=preset, path=config_file, overrides=(*overrides, *against))
    report = step_report(subject, peer, batch_size=batch_size or subject.train.batch_size,
                         repeats=repeats, rounds=rounds)
    report["against"] = list(against)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    for number, r in enumerate(report["rounds_detail"], 1):
        click.echo(f"round {number}: subject {r['subject_step_s'] * 1e3:8.1f} ms, peer "
                   f"{r['peer_step_s'] * 1e3:8.1f} ms, ratio {r['ratio']:.3f}")
    click.echo(f"subject ({report['config']}) / peer ({' '.join(against)}): step time "
               f"{report['time_ratio_median']:.3f}x (median of {rounds} rounds of {repeats} "
               f"steps), training FLOPs {report['flop_ratio']:.3f}x "
               f"({report['subject_train_flops']:.3g} against {report['peer_train_flops']:.3g})")
