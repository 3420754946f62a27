"""Peers side by side: RecBole 1.2.1's DIN, DIEN, DCNV2 and DeepFM trained and evaluated on
exactly the impressions a run of this trainer trains and evaluates on (any data source:
``synthetic-ads`` by default, ``movielens-100k``, ``parquet``), every model's NE, AUC and GAUC
computed by ``gem_core.metrics``.

    python tools/peers.py --planted multi_valued --steps 600 --batch-size 256 --seed 0 \
        --eval-rows 8192 --max-seq-len 64 --models DIN,DeepFM,DCNV2,DIEN \
        --out runs/peers-multi_valued [--ours runs/x runs/y]
    python tools/peers.py --data movielens-100k --steps 300 --out runs/peers-movielens \
        [--ours runs/movielens-tiny]

1. Export (:mod:`gem_data.peer_export`): the training impressions of a run with ``[data]``
   (``--data``, ``--data-path``, ``--max-seq-len``, ``--eval-rows``, ``data.options`` from
   ``--planted`` and ``--option KEY=VALUE``), ``train.steps``, ``train.batch_size``,
   ``train.seed`` and ``train.epochs`` (``--train-epochs``), and its eval split, as RecBole
   atomic files in ``OUT/peers/``. The defaults are what a run would use:

   - ``synthetic-ads``: ``planted = "ads"``, ``max_seq_len`` 256, ``eval_rows`` 8192 (the
     generated eval split has no end; these are this tool's long-standing defaults).
   - any other source: no ``data.options``; ``max_seq_len`` as ``gem train --data SOURCE``
     applies it: the default preset's (``tiny``: 128), giving way to a data set's own cap
     as in a run (MovieLens-100k is converted with the run's ``max_seq_len`` as its cap, so
     128); ``eval_rows`` unset: the whole eval split, as such a run evaluates.
     ``--planted`` is refused (it is a ``synthetic-ads`` option).
   - ``--train-epochs`` 1 (the trainer's ``train.epochs`` default): on a file-backed data set
     a run stops after one pass over its training split when that comes before
     ``train.steps`` (MovieLens-100k at batch 256: after 174 steps), and so does the export.
     Generated data has no passes.
   - ``--tasks``: the data's first task (``click`` on ``synthetic-ads``, ``like`` on
     MovieLens).
2. Peers: in a venv of their own (``--peers-venv``, default ``.cache/peers-venv``, created from
   ``tools/peers-requirements.txt`` when missing or when that file changed), each model trains
   with RecBole's default sizes and optimiser for ``--epochs`` passes (default 1: the single
   pass this trainer makes) and scores the eval impressions (``tools/peers_recbole.py``, which
   says what each model reads), in ``OUT/runs/<model>-<task>/``. ``--history-keep
   FEATURE=ID,...`` gives DIN and DIEN only the history events whose ``FEATURE`` has one of
   these raw ids (``action=1,2``: the clicked and converted ones, DIN's behaviour sequence);
   their predictions are kept apart (``OUT/runs/<model>-<task>-keep-.../``). On data whose
   history has no item ids (the export's ``history_item_ids`` false: a Taobao-shaped log,
   whose events name a category and a brand, not the ad) DIN and DIEN, which read the history
   as item ids, are refused after the export and before any training (:func:`check_models`).
3. Metrics: back here, NE, AUC, GAUC (per-user AUC weighted by impressions, over users with
   both classes) of every peer's predictions against the exported labels and users, and of
   two references without a model (``gem_data.peer_references.REFERENCES``: each item's
   training rate; the user's and the item's offsets learnt in one pass as ``model.id_bias``
   learns them); with
   ``--ours RUN_DIR ...`` also the eval figures of this trainer's finished runs
   (``summary.json``'s ``eval_last``: the model as its training ended, as every peer's is, not
   the checkpoint a run picks by its eval NE, which would be chosen on the very impressions
   reported), after checking that each run's data is the export's (source, path,
   order, options, seed, steps trained, batch size, eval rows, history length): a run on other
   data is refused, naming the keys that differ.
4. ``--validation-share S``: for runs trained with ``train.validation_share = S``. Every figure
   (peers, references, ours) is then of the eval impressions outside that validation part
   (the same users, by the same hash: ``gem_core.train.evaluate.in_validation``), and ours
   are each run's headline ``eval``: the checkpoint chosen on the validation part, which no
   reported impression decided. Runs with another share are refused.

Writes ``OUT/peers.md`` (a markdown table, also printed) and ``OUT/peers.json``. The export
and each peer's predictions are kept: a second call with the same data and epochs reuses them
(``--fresh`` redoes everything).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch

from gem_core.errors import GemError
from gem_data.peer_references import REFERENCES, peer_metrics

if TYPE_CHECKING:
    from gem_core.config import DataConfig

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "tools" / "peers-requirements.txt"
RUNNER = ROOT / "tools" / "peers_recbole.py"
DEFAULT_VENV = ROOT / ".cache" / "peers-venv"
MODELS = ("DIN", "DIEN", "DCNV2", "DeepFM")
SEQUENTIAL = ("DIN", "DIEN")
"""The peers that read the history as a sequence (``--history-keep`` filters theirs)."""
EXPORT_NAME = "peers"
RECBOLE_TRAIN_BATCH_SIZE = 2048
"""RecBole 1.2.1's ``train_batch_size`` (``overall.yaml``), the peers' default here."""


# -- the peers venv ------------------------------------------------------------------------------

def ensure_venv(venv: Path) -> Path:
    """The peers venv's python, creating the venv (or installing anew) when it is missing or
    was made from another ``tools/peers-requirements.txt``."""
    python = venv / "bin" / "python"
    wanted = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()
    stamp = venv / ".gem-peers-requirements"
    if python.exists() and stamp.exists() and stamp.read_text().strip() == wanted:
        return python
    if not python.exists():
        print(f"creating the peers venv {venv}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    print(f"installing {REQUIREMENTS.name} into {venv}", file=sys.stderr)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "-r", str(REQUIREMENTS)],
                   check=True)
    stamp.write_text(wanted + "\n")
    return python


# -- export --------------------------------------------------------------------------------------

SYNTHETIC_ADS = "synthetic-ads"
SYNTHETIC_ADS_DEFAULTS = {"planted": "ads", "max_seq_len": 256, "eval_rows": 8192}
"""``synthetic-ads``'s defaults here (``--planted``, ``--max-seq-len``, ``--eval-rows``)."""


def data_config(args: argparse.Namespace) -> DataConfig:
    """The ``[data]`` of the run to export, from the command line and the defaults of the module
    docstring."""
    from gem_core.config import DataConfig, load_config

    pairs = _option_pairs(args.option)
    if args.data == SYNTHETIC_ADS:
        def given(value: Any, key: str) -> Any:
            return SYNTHETIC_ADS_DEFAULTS[key] if value is None else value

        return DataConfig(source=args.data, path=args.data_path,
                          max_seq_len=given(args.max_seq_len, "max_seq_len"),
                          eval_rows=given(args.eval_rows, "eval_rows"),
                          options={"planted": given(args.planted, "planted"), **pairs})
    if args.planted is not None:
        raise SystemExit(f"--planted sets data.options.planted of {SYNTHETIC_ADS}; data source "
                         f"{args.data!r} has no planted patterns (--option KEY=VALUE sets its "
                         "data.options)")
    if args.max_seq_len is not None:
        max_seq_len, data_set_wins = args.max_seq_len, ()
    else:
        # As `gem train --data SOURCE`: the default preset's value, which a data set's own cap
        # replaces (the trainer marks a value the user did not choose so).
        preset = load_config(overrides=[f"data.source={args.data}"]).data
        max_seq_len, data_set_wins = preset.max_seq_len, ("max_seq_len",)
    return DataConfig(source=args.data, path=args.data_path, max_seq_len=max_seq_len,
                      eval_rows=args.eval_rows, options=pairs, data_set_wins=data_set_wins)


def _export_key(args: argparse.Namespace, data: DataConfig) -> dict[str, Any]:
    # As the manifest stores it (JSON: tuples read back as lists).
    return json.loads(json.dumps({
        "data_given": attrs.asdict(data), "seed": args.seed, "train_steps": args.steps,
        "train_epochs": args.train_epochs, "batch_size": args.batch_size}))


def export(args: argparse.Namespace, data: DataConfig) -> tuple[Path, dict[str, Any]]:
    """The export directory and its manifest, written anew unless an export of the same data
    is there."""
    from gem_data.peer_export import FORMAT, export_peer_dataset

    directory = args.out / EXPORT_NAME
    manifest_file = directory / "manifest.json"
    key = _export_key(args, data)
    if manifest_file.exists() and not args.fresh:
        manifest = json.loads(manifest_file.read_text())
        if manifest.get("format") == FORMAT and all(manifest.get(k) == v
                                                    for k, v in key.items()):
            return directory, manifest
    shutil.rmtree(args.out / "runs", ignore_errors=True)  # predictions of other data
    shutil.rmtree(directory, ignore_errors=True)
    started = time.perf_counter()
    try:
        manifest = export_peer_dataset(directory, data=data, seed=args.seed, steps=args.steps,
                                       batch_size=args.batch_size, epochs=args.train_epochs,
                                       name=EXPORT_NAME)
    except GemError as error:  # the data cannot be exported: say why, without a traceback
        raise SystemExit(f"cannot export the {data.source} data: {error}") from None
    print(f"exported {manifest['train_impressions']} training and "
          f"{manifest['eval_impressions']} eval impressions to {directory} in "
          f"{time.perf_counter() - started:.1f} s", file=sys.stderr)
    return directory, manifest


# -- peer runs -----------------------------------------------------------------------------------

def _runner() -> Any:
    """``tools/peers_recbole.py`` as a module (it imports RecBole only in its ``main``), for its
    rules on what each model needs of an export."""
    spec = importlib.util.spec_from_file_location("_peers_recbole", RUNNER)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {RUNNER}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_models(manifest: dict[str, Any], models: list[str], directory: Path) -> None:
    """Refuses (SystemExit, every reason) the peers that cannot run on the export of
    ``manifest`` in ``directory`` (``peers_recbole.model_refusal``: DIN and DIEN on a history
    without item ids), before any of them trains."""
    refusals = [reason for reason in (_runner().model_refusal(manifest, model)
                                      for model in models) if reason]
    if refusals:
        raise SystemExit(f"cannot run these peers on the export {directory}:\n  "
                         + "\n  ".join(refusals) + "\n(leave them out of --models)")


def run_peer(python: Path, data: Path, model: str, task: str, args: argparse.Namespace
             ) -> tuple[np.ndarray, dict[str, Any]]:
    """One peer's eval probabilities and its ``run.json``, trained unless already there."""
    keep = args.history_keep if model in SEQUENTIAL else None
    # a filtered history is another peer: its predictions are kept beside the full one's
    suffix = "-keep-" + keep.replace("=", "-").replace(",", "-") if keep else ""
    out = args.out / "runs" / f"{model}-{task}{suffix}"
    report_file, predictions_file = out / "run.json", out / "predictions.npy"
    if report_file.exists() and predictions_file.exists() and not args.fresh:
        report = json.loads(report_file.read_text())
        bags = args.context_history == "bags" and model in ("DeepFM", "DCNV2")
        if (report.get("epochs") == args.epochs and report.get("seed") == args.recbole_seed
                and report.get("history_bags") == bags
                and (report.get("history_keep") or {}).get("option") == keep
                # runs from before the option all trained at RecBole's default
                and report.get("train_batch_size", RECBOLE_TRAIN_BATCH_SIZE)
                == (args.peer_batch_size or RECBOLE_TRAIN_BATCH_SIZE)):
            return np.load(predictions_file), report
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    command = [str(python), str(RUNNER), "--data", str(data.resolve()), "--model", model,
               "--task", task, "--epochs", str(args.epochs), "--seed", str(args.recbole_seed),
               "--out", str(out.resolve())]
    if args.context_history == "bags":
        command.append("--history-bags")
    if keep:
        command += ["--history-keep", keep]
    if args.peer_batch_size:
        command += ["--train-batch-size", str(args.peer_batch_size)]
    print(f"training {model} on {task} (log: {out / 'recbole.log'})", file=sys.stderr)
    with (out / "recbole.log").open("w") as log:
        result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    if result.returncode != 0:
        tail = (out / "recbole.log").read_text().splitlines()[-20:]
        raise SystemExit(f"{model} on {task} failed (exit {result.returncode}):\n"
                         + "\n".join(tail))
    return np.load(predictions_file), json.loads(report_file.read_text())


def reported_part(users: np.ndarray, share: float) -> np.ndarray:
    """Which eval impressions a run with ``train.validation_share = share`` reports: those whose
    user is outside its validation part (all of them for 0)."""
    from gem_core.train.evaluate import in_validation

    if not share:
        return np.ones(users.shape, dtype=bool)
    return ~in_validation(torch.from_numpy(users.astype(np.int64)), share).numpy()


# -- our runs ------------------------------------------------------------------------------------

def our_figures(run_dir: Path, manifest: dict[str, Any], tasks: list[str], *,
                validation_share: float = 0.0, reported: int | None = None) -> dict[str, Any]:
    """A run's figures on the export's eval impressions: its last evaluation, or with
    ``validation_share`` its headline (the checkpoint chosen on the validation part) over the
    ``reported`` impressions outside that part."""
    summary_file = run_dir / "summary.json"
    if not summary_file.exists():
        raise SystemExit(f"{run_dir} is not a finished run: {summary_file} is missing")
    summary = json.loads(summary_file.read_text())
    from gem_data.peer_runs import run_data_differences

    differences = run_data_differences(summary, manifest)
    if differences:
        raise SystemExit(f"{run_dir} was not trained and evaluated on the exported impressions; "
                         "it differs in:\n  " + "\n  ".join(differences))
    share = summary.get("config", {}).get("train", {}).get("validation_share", 0.0)
    if share != validation_share:
        raise SystemExit(f"{run_dir} was trained with train.validation_share = {share}; this "
                         f"table is of --validation-share {validation_share}")
    figures: dict[str, Any] = {}
    # The last evaluation: a peer reports its model at the end of training; a run's headline
    # (``eval``) may be an earlier checkpoint, the best on these very eval impressions, unless
    # a validation part (other users) chose it.
    key = "eval" if validation_share else "eval_last"
    chosen = summary.get(key)
    if chosen is None:
        raise SystemExit(f"{summary_file} has no {key}; a run of this version writes it")
    expected = manifest["eval_impressions"] if reported is None else reported
    for task in tasks:
        report = chosen.get(task)
        if report is None:
            raise SystemExit(f"{run_dir} has no eval figures for {task}")
        if report.get("samples") != expected:
            raise SystemExit(f"{run_dir} reports {report.get('samples')} eval impressions; "
                             f"{expected} of the export's {manifest['eval_impressions']} are "
                             f"outside the validation part of share {validation_share}")
        figures[task] = report
    return {"run_dir": str(run_dir), "preset": summary["run"].get("name"),
            "wall_time_s": summary["run"].get("wall_time_s"), "eval": figures}


# -- output --------------------------------------------------------------------------------------

def _f(value: Any, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def describe_data(manifest: dict[str, Any]) -> str:
    """The markdown table's ``Data:`` sentence: the source, its options, what was trained on
    and evaluated."""
    options = ", ".join(f"{k}={v}" for k, v in manifest["options_given"].items()) or "defaults"
    history = f"histories of at most {manifest['max_seq_len']} events"
    if not manifest.get("history_item_ids", True):  # older manifests: always with item ids
        history += (f" without item ids (the events' {', '.join(manifest['event_features'])} "
                    "only)")
    if manifest["source"] == SYNTHETIC_ADS:
        return (f"`synthetic-ads` ({options}), seed {manifest['seed']} (data seed "
                f"{manifest['data_seed']}), {manifest['steps']} steps x {manifest['batch_size']} "
                f"requests = {manifest['train_impressions']} training impressions; eval "
                f"{manifest['eval_rows']} requests = {manifest['eval_impressions']} "
                f"impressions; {history}.")
    where = f" at `{manifest['path']}`" if manifest["path"] else ""
    steps = f"{manifest['steps']} steps x {manifest['batch_size']} requests"
    if manifest["steps"] < manifest["train_steps"]:  # ended by train.epochs, as a run does
        passes = manifest["train_epochs"]
        steps += (f" ({'one pass' if passes == 1 else f'{passes} passes'} over the training "
                  f"split: train.epochs = {passes}, before train.steps = "
                  f"{manifest['train_steps']})")
    evaluated = ("the whole eval split" if manifest["eval_rows"] is None
                 else f"the first {manifest['eval_rows']} requests")
    return (f"`{manifest['source']}`{where} ({options}), seed {manifest['seed']} (the "
            f"training order), {steps} = {manifest['train_requests']} requests, "
            f"{manifest['train_impressions']} training impressions; eval {evaluated}: "
            f"{manifest['eval_requests']} requests = {manifest['eval_impressions']} "
            f"impressions; {history}.")


def markdown(result: dict[str, Any], command: str) -> str:
    manifest, tasks = result["export"], result["tasks"]
    share = result.get("validation_share") or 0.0
    ours_note = ("Ours: each run's last evaluation (its model as training ended, as the "
                 "peers')." if not share else
                 f"Every figure is of the {result['reported_impressions']} eval impressions "
                 f"outside the validation part (train.validation_share = {share}, by user); "
                 "ours: each run's checkpoint chosen on that validation part.")
    history = ("with the history as bags of ids" if result["context_history"] == "bags"
               else "without the history")
    keep = result.get("history_keep")
    if keep:
        feature, _, ids = keep.partition("=")
        history += (f"; DIN and DIEN with the history events whose {feature} is "
                    f"{' or '.join(ids.split(','))} only")
    lines = [
        f"`{command}`",
        "",
        f"Data: {describe_data(manifest)} Peers: RecBole "
        f"{result['recbole'] or '-'}, default sizes, {result['epochs']} epoch(s) of "
        f"{result.get('peer_batch_size') or RECBOLE_TRAIN_BATCH_SIZE} impressions a step; "
        f"DeepFM and "
        f"DCNV2 {history}. {ours_note} Metrics: gem_core.metrics.",
        "",
    ]
    head = ["model", *[f"{t} {m}" for t in tasks for m in ("NE", "AUC", "GAUC")],
            "params", "train s"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, entry in result["peers"].items():
        kept = next(iter(entry.values()))["run"].get("history_keep")
        cells = [name + (f" ({kept['events_kept']:,} of {kept['events']:,} history events)"
                         if kept else "")]
        for task in tasks:
            m = entry.get(task, {}).get("metrics", {})
            cells += [_f(m.get("ne")), _f(m.get("auc")), _f(m.get("gauc"))]
        first = next(iter(entry.values()))["run"]
        cells += [f"{first['parameters']:,}",
                  " / ".join(f"{entry[t]['run']['train_s']:.0f}" for t in tasks if t in entry)]
        lines.append("| " + " | ".join(cells) + " |")
    for name, entry in result["ours"].items():
        cells = [f"ours: {name} ({entry['preset']})"]
        for task in tasks:
            m = entry["eval"][task]
            cells += [_f(m.get("ne")), _f(m.get("auc")), _f(m.get("gauc"))]
        wall = entry.get("wall_time_s")
        cells += ["-", f"{wall:.0f} (run)" if wall else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    for name, entry in result.get("references", {}).items():
        cells = [f"reference: {name} ({REFERENCES[name][1]})"]
        for task in tasks:
            m = entry[task]
            cells += [_f(m.get("ne")), _f(m.get("auc")), _f(m.get("gauc"))]
        lines.append("| " + " | ".join(cells + ["-", "-"]) + " |")
    if manifest.get("achievable_ne") is not None:  # generated data knows its true probabilities
        cells = ["achievable (true probabilities" + (", whole eval split)" if share else ")")]
        for task in tasks:
            cells += [_f(manifest.get(f"achievable_{metric}", {}).get(task))
                      for metric in ("ne", "auc", "gauc")]
        lines.append("| " + " | ".join(cells + ["-", "-"]) + " |")
    return "\n".join(lines) + "\n"


def _option_pairs(pairs: list[str]) -> dict[str, Any]:
    """``--option KEY=VALUE`` as ``data.options`` (a JSON value, else the string)."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--option {pair!r}: expected KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=SYNTHETIC_ADS,
                        help="data.source: the run's data source (gem plugins lists them)")
    parser.add_argument("--data-path", default="",
                        help="data.path, for a file-backed source (parquet: the data set)")
    parser.add_argument("--planted", default=None,
                        help="data.options.planted of synthetic-ads (default ads); refused for "
                             "other sources")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="a data.options key (JSON value or string); repeatable")
    parser.add_argument("--steps", type=int, default=600, help="train.steps")
    parser.add_argument("--batch-size", type=int, default=256, help="train.batch_size")
    parser.add_argument("--seed", type=int, default=0, help="train.seed")
    parser.add_argument("--train-epochs", type=int, default=1,
                        help="train.epochs: a run on a data set stops after that many passes "
                             "over its training split if before train.steps (0: steps alone); "
                             "generated data has no passes")
    parser.add_argument("--eval-rows", type=int, default=None,
                        help="data.eval_rows (default: 8192 on synthetic-ads, else unset: the "
                             "whole eval split)")
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="data.max_seq_len (default: 256 on synthetic-ads, else as `gem "
                             "train --data SOURCE` applies it: 128 on movielens-100k)")
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated peers among {', '.join(MODELS)} ('' for none)")
    parser.add_argument("--tasks", default=None,
                        help="comma-separated tasks, one peer training each (default: the "
                             "data's first: click on synthetic-ads, like on movielens-100k)")
    parser.add_argument("--epochs", type=int, default=1, help="passes of each peer")
    parser.add_argument("--peer-batch-size", type=int, default=None,
                        help="impressions per training step of every peer (default: RecBole's "
                             f"{RECBOLE_TRAIN_BATCH_SIZE}; one pass at 2048 is few updates)")
    parser.add_argument("--recbole-seed", type=int, default=2020, help="RecBole's seed")
    parser.add_argument("--context-history", choices=("none", "bags"), default="none",
                        help="DeepFM, DCNV2: without the history, or with its columns as bags "
                             "of ids (see tools/peers_recbole.py)")
    parser.add_argument("--history-keep", default=None, metavar="FEATURE=ID,...",
                        help="DIN, DIEN: only the history events whose FEATURE has one of "
                             "these raw ids, e.g. action=1,2 (clicks and conversions: DIN's "
                             "behaviour sequence) or rating=3,4 on MovieLens (4 and 5 stars)")
    parser.add_argument("--validation-share", type=float, default=0.0,
                        help="train.validation_share of the --ours runs: every figure is then "
                             "of the eval impressions outside that validation part")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ours", type=Path, nargs="+", default=[], metavar="RUN_DIR",
                        help="this trainer's finished runs on the same data")
    parser.add_argument("--peers-venv", type=Path, default=DEFAULT_VENV)
    parser.add_argument("--fresh", action="store_true",
                        help="export and train again even where results are kept")
    args = parser.parse_args(argv)

    models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    data = data_config(args)
    args.out.mkdir(parents=True, exist_ok=True)

    directory, manifest = export(args, data)
    check_models(manifest, models, directory)
    tasks = ([t for t in args.tasks.split(",") if t] if args.tasks is not None
             else manifest["tasks"][:1])
    unknown = sorted(set(tasks) - set(manifest["tasks"]))
    if unknown:
        parser.error(f"unknown tasks {unknown}; the data has {manifest['tasks']}")
    keys = np.load(directory / "eval_keys.npz")
    keep = reported_part(keys["user_ids"], args.validation_share)
    # Our runs are checked before hours of peer training.
    ours = {run.name: our_figures(run, manifest, tasks, validation_share=args.validation_share,
                                  reported=int(keep.sum()))
            for run in args.ours}
    peers: dict[str, dict[str, Any]] = {}
    recbole = None
    if models:
        python = ensure_venv(args.peers_venv)
        for model in models:
            for task in tasks:
                probabilities, report = run_peer(python, directory, model, task, args)
                recbole = report.get("recbole")
                peers.setdefault(model, {})[task] = {
                    "metrics": peer_metrics(probabilities, keys[task], keys["user_ids"],
                                            keep),
                    "run": report}

    try:
        references = {name: {task: reference(directory, task, keys, keep, name=EXPORT_NAME)
                             for task in tasks}
                      for name, (reference, _) in REFERENCES.items()}
    except GemError as error:  # an export that does not hold together: say why
        raise SystemExit(f"no-model references on {directory}: {error}") from None
    export_summary = {k: v for k, v in manifest.items() if k not in ("columns", "item_columns")}
    result = {"tasks": tasks, "epochs": args.epochs, "peer_batch_size": args.peer_batch_size,
              "recbole": recbole, "references": references,
              "context_history": args.context_history, "history_keep": args.history_keep,
              "validation_share": args.validation_share, "reported_impressions": int(keep.sum()),
              "export": export_summary, "peers": peers, "ours": ours}
    command = "python tools/peers.py " + " ".join(sys.argv[1:] if argv is None else argv)
    table = markdown(result, command)
    (args.out / "peers.md").write_text(table)
    (args.out / "peers.json").write_text(json.dumps({"command": command, **result}, indent=1,
                                                    default=str) + "\n")
    print(table)


if __name__ == "__main__":
    main()
