"""Peers side by side: RecBole 1.2.1's DIN, DIEN, DCNV2 and DeepFM trained and evaluated on
exactly the impressions a ``synthetic-ads`` run of this trainer trains and evaluates on, every
model's NE, AUC and GAUC computed by ``gem_core.metrics``.

    python tools/peers.py --planted multi_valued --steps 600 --batch-size 256 --seed 0 \
        --eval-rows 8192 --max-seq-len 64 --models DIN,DeepFM,DCNV2,DIEN \
        --out runs/peers-multi_valued [--ours runs/x runs/y]

1. Export (:mod:`gem_data.peer_export`): the training impressions of a run with
   ``train.steps``, ``train.batch_size``, ``train.seed``, ``data.max_seq_len`` and
   ``data.options`` (``planted`` and ``--option KEY=VALUE``) and its eval split
   (``data.eval_rows`` requests) as RecBole atomic files in ``OUT/peers/``.
2. Peers: in a venv of their own (``--peers-venv``, default ``.cache/peers-venv``, created from
   ``tools/peers-requirements.txt`` when missing or when that file changed), each model trains
   with RecBole's default sizes and optimiser for ``--epochs`` passes (default 1: the single
   pass this trainer makes) and scores the eval impressions (``tools/peers_recbole.py``, which
   says what each model reads), in ``OUT/runs/<model>-<task>/``.
3. Metrics: back here, NE, AUC, GAUC (per-user AUC weighted by impressions, over users with
   both classes) of every peer's predictions against the exported labels and users; with
   ``--ours RUN_DIR ...`` also the eval figures of this trainer's finished runs
   (``summary.json``), after checking that each run's data is the export's (source, options,
   seed, steps, batch size, eval rows, history length): a run on other data is refused,
   naming the keys that differ.

Writes ``OUT/peers.md`` (a markdown table, also printed) and ``OUT/peers.json``. The export
and each peer's predictions are kept: a second call with the same data and epochs reuses them
(``--fresh`` redoes everything).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "tools" / "peers-requirements.txt"
RUNNER = ROOT / "tools" / "peers_recbole.py"
DEFAULT_VENV = ROOT / ".cache" / "peers-venv"
MODELS = ("DIN", "DIEN", "DCNV2", "DeepFM")
EXPORT_NAME = "peers"
PROBABILITY_EPS = 1e-7
"""Predicted probabilities are clipped to ``[eps, 1 - eps]`` before they become logits for
``gem_core.metrics`` (RecBole's models output float32 probabilities)."""


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

def _export_key(args: argparse.Namespace, options: dict[str, Any]) -> dict[str, Any]:
    return {"options_given": options, "seed": args.seed, "steps": args.steps,
            "batch_size": args.batch_size, "eval_rows": args.eval_rows,
            "max_seq_len": args.max_seq_len}


def export(args: argparse.Namespace, options: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    """The export directory and its manifest, written anew unless an export of the same data
    is there."""
    from gem_data.peer_export import FORMAT, export_peer_dataset

    directory = args.out / EXPORT_NAME
    manifest_file = directory / "manifest.json"
    key = _export_key(args, options)
    if manifest_file.exists() and not args.fresh:
        manifest = json.loads(manifest_file.read_text())
        if manifest.get("format") == FORMAT and all(manifest.get(k) == v
                                                    for k, v in key.items()):
            return directory, manifest
    shutil.rmtree(args.out / "runs", ignore_errors=True)  # predictions of other data
    shutil.rmtree(directory, ignore_errors=True)
    started = time.perf_counter()
    manifest = export_peer_dataset(directory, options=options, seed=args.seed,
                                   steps=args.steps, batch_size=args.batch_size,
                                   eval_rows=args.eval_rows, max_seq_len=args.max_seq_len,
                                   name=EXPORT_NAME)
    print(f"exported {manifest['train_impressions']} training and "
          f"{manifest['eval_impressions']} eval impressions to {directory} in "
          f"{time.perf_counter() - started:.1f} s", file=sys.stderr)
    return directory, manifest


# -- peer runs -----------------------------------------------------------------------------------

def run_peer(python: Path, data: Path, model: str, task: str, args: argparse.Namespace
             ) -> tuple[np.ndarray, dict[str, Any]]:
    """One peer's eval probabilities and its ``run.json``, trained unless already there."""
    out = args.out / "runs" / f"{model}-{task}"
    report_file, predictions_file = out / "run.json", out / "predictions.npy"
    if report_file.exists() and predictions_file.exists() and not args.fresh:
        report = json.loads(report_file.read_text())
        bags = args.context_history == "bags" and model in ("DeepFM", "DCNV2")
        if (report.get("epochs") == args.epochs and report.get("seed") == args.recbole_seed
                and report.get("history_bags") == bags):
            return np.load(predictions_file), report
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    command = [str(python), str(RUNNER), "--data", str(data.resolve()), "--model", model,
               "--task", task, "--epochs", str(args.epochs), "--seed", str(args.recbole_seed),
               "--out", str(out.resolve())]
    if args.context_history == "bags":
        command.append("--history-bags")
    print(f"training {model} on {task} (log: {out / 'recbole.log'})", file=sys.stderr)
    with (out / "recbole.log").open("w") as log:
        result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    if result.returncode != 0:
        tail = (out / "recbole.log").read_text().splitlines()[-20:]
        raise SystemExit(f"{model} on {task} failed (exit {result.returncode}):\n"
                         + "\n".join(tail))
    return np.load(predictions_file), json.loads(report_file.read_text())


def peer_metrics(probabilities: np.ndarray, labels: np.ndarray,
                 users: np.ndarray) -> dict[str, float]:
    """``gem_core.metrics.task_report`` of predicted probabilities (as logits)."""
    from gem_core.metrics import task_report

    if probabilities.shape != labels.shape:
        raise SystemExit(f"{probabilities.size} predictions for {labels.size} eval impressions")
    p = np.clip(probabilities.astype(np.float64), PROBABILITY_EPS, 1 - PROBABILITY_EPS)
    logits = torch.from_numpy(np.log(p) - np.log1p(-p))
    return task_report(logits, torch.from_numpy(labels.astype(np.float64)),
                       torch.from_numpy(users.astype(np.int64)))


# -- our runs ------------------------------------------------------------------------------------

def _resolved_options(options: dict[str, Any], max_seq_len: int) -> dict[str, Any]:
    from gem_core.config import structure
    from gem_data.synth_options import SynthOptions

    return attrs.asdict(structure(SynthOptions, {"max_length": max_seq_len, **options},
                                  "data.options"))


def ours_differences(summary: dict[str, Any], manifest: dict[str, Any]) -> list[str]:
    """The keys on which a run (its ``summary.json``) was trained or evaluated on other data than
    the export, each with both values; empty when the data is the same."""
    config = summary.get("config", {})
    data, train = config.get("data", {}), config.get("train", {})
    differences = []

    def compare(key: str, ours: Any, exported: Any) -> None:
        if ours != exported:
            differences.append(f"{key} = {ours!r} (the export: {exported!r})")

    compare("data.source", data.get("source"), manifest["source"])
    if differences:
        return differences
    compare("data.eval_rows", data.get("eval_rows"), manifest["eval_rows"])
    compare("data.max_seq_len", data.get("max_seq_len"), manifest["max_seq_len"])
    compare("train.steps", train.get("steps"), manifest["steps"])
    compare("train.batch_size", train.get("batch_size"), manifest["batch_size"])
    compare("run.steps (steps trained)", summary.get("run", {}).get("steps"), manifest["steps"])
    try:
        options = _resolved_options(data.get("options", {}), data.get("max_seq_len", 0))
    except Exception as error:  # a run of another version: say why
        return differences + [f"data.options do not read as this version's ({error})"]
    for key in sorted(set(options) | set(manifest["options"])):
        compare(f"data.options.{key}", options.get(key), manifest["options"].get(key))
    data_seed = options["data_seed"] if options.get("data_seed", -1) >= 0 else train.get("seed")
    compare("data seed (data.options.data_seed, else train.seed)", data_seed,
            manifest["data_seed"])
    return differences


def our_figures(run_dir: Path, manifest: dict[str, Any], tasks: list[str]) -> dict[str, Any]:
    summary_file = run_dir / "summary.json"
    if not summary_file.exists():
        raise SystemExit(f"{run_dir} is not a finished run: {summary_file} is missing")
    summary = json.loads(summary_file.read_text())
    differences = ours_differences(summary, manifest)
    if differences:
        raise SystemExit(f"{run_dir} was not trained and evaluated on the exported impressions; "
                         "it differs in:\n  " + "\n  ".join(differences))
    figures: dict[str, Any] = {}
    for task in tasks:
        report = summary["eval"].get(task)
        if report is None:
            raise SystemExit(f"{run_dir} has no eval figures for {task}")
        if report.get("samples") != manifest["eval_impressions"]:
            raise SystemExit(f"{run_dir} evaluated {report.get('samples')} impressions, the "
                             f"export has {manifest['eval_impressions']}")
        figures[task] = report
    return {"run_dir": str(run_dir), "preset": summary["run"].get("name"),
            "wall_time_s": summary["run"].get("wall_time_s"), "eval": figures}


# -- output --------------------------------------------------------------------------------------

def _f(value: Any, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def markdown(result: dict[str, Any], command: str) -> str:
    manifest, tasks = result["export"], result["tasks"]
    options = ", ".join(f"{k}={v}" for k, v in manifest["options_given"].items()) or "defaults"
    history = ("with the history as bags of ids" if result["context_history"] == "bags"
               else "without the history")
    lines = [
        f"`{command}`",
        "",
        f"Data: `synthetic-ads` ({options}), seed {manifest['seed']} (data seed "
        f"{manifest['data_seed']}), {manifest['steps']} steps x {manifest['batch_size']} "
        f"requests = {manifest['train_impressions']} training impressions; eval "
        f"{manifest['eval_rows']} requests = {manifest['eval_impressions']} impressions; "
        f"histories of at most {manifest['max_seq_len']} events. Peers: RecBole "
        f"{result['recbole'] or '-'}, default sizes, {result['epochs']} epoch(s); DeepFM and "
        f"DCNV2 {history}. Metrics: gem_core.metrics.",
        "",
    ]
    head = ["model", *[f"{t} {m}" for t in tasks for m in ("NE", "AUC", "GAUC")],
            "params", "train s"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, entry in result["peers"].items():
        cells = [name]
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
    achievable = manifest.get("achievable_ne", {})
    cells = ["achievable (true probabilities)"]
    for task in tasks:
        cells += [_f(achievable.get(task)), "-", "-"]
    lines.append("| " + " | ".join(cells + ["-", "-"]) + " |")
    return "\n".join(lines) + "\n"


def _options(planted: str, pairs: list[str]) -> dict[str, Any]:
    options: dict[str, Any] = {"planted": planted}
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
    parser.add_argument("--planted", default="ads", help="data.options.planted")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="another data.options key (JSON value or string); repeatable")
    parser.add_argument("--steps", type=int, default=600, help="train.steps")
    parser.add_argument("--batch-size", type=int, default=256, help="train.batch_size")
    parser.add_argument("--seed", type=int, default=0, help="train.seed")
    parser.add_argument("--eval-rows", type=int, default=8192, help="data.eval_rows")
    parser.add_argument("--max-seq-len", type=int, default=256, help="data.max_seq_len")
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated peers among {', '.join(MODELS)} ('' for none)")
    parser.add_argument("--tasks", default="click",
                        help="comma-separated tasks, one peer training each (click,conversion)")
    parser.add_argument("--epochs", type=int, default=1, help="passes of each peer")
    parser.add_argument("--recbole-seed", type=int, default=2020, help="RecBole's seed")
    parser.add_argument("--context-history", choices=("none", "bags"), default="none",
                        help="DeepFM, DCNV2: without the history, or with its columns as bags "
                             "of ids (see tools/peers_recbole.py)")
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
    tasks = [t for t in args.tasks.split(",") if t]
    options = _options(args.planted, args.option)
    args.out.mkdir(parents=True, exist_ok=True)

    data, manifest = export(args, options)
    unknown = sorted(set(tasks) - set(manifest["tasks"]))
    if unknown:
        parser.error(f"unknown tasks {unknown}; the data has {manifest['tasks']}")
    # Our runs are checked before hours of peer training.
    ours = {run.name: our_figures(run, manifest, tasks) for run in args.ours}

    keys = np.load(data / "eval_keys.npz")
    peers: dict[str, dict[str, Any]] = {}
    recbole = None
    if models:
        python = ensure_venv(args.peers_venv)
        for model in models:
            for task in tasks:
                probabilities, report = run_peer(python, data, model, task, args)
                recbole = report.get("recbole")
                peers.setdefault(model, {})[task] = {
                    "metrics": peer_metrics(probabilities, keys[task], keys["user_ids"]),
                    "run": report}

    export_summary = {k: v for k, v in manifest.items() if k not in ("columns", "item_columns")}
    result = {"tasks": tasks, "epochs": args.epochs, "recbole": recbole,
              "context_history": args.context_history,
              "export": export_summary, "peers": peers, "ours": ours}
    command = "python tools/peers.py " + " ".join(sys.argv[1:] if argv is None else argv)
    table = markdown(result, command)
    (args.out / "peers.md").write_text(table)
    (args.out / "peers.json").write_text(json.dumps({"command": command, **result}, indent=1,
                                                    default=str) + "\n")
    print(table)


if __name__ == "__main__":
    main()
