"""Streaming training against a model trained once on a shuffled past (issue #27, item 4).

``python tools/measure_streaming.py --out /tmp/streaming`` runs, through the ``gem`` CLI:

1. ``gem data synth --windows N --window-rows R``: a drifting synthetic log of N windows;
2. **streaming**: ``data.order = time`` over every window, each evaluated before training on it
   (progressive evaluation);
3. **shuffled past**: the same ``tiny`` model trained on windows ``0 .. N-3``, the rows of all
   of them shuffled together (``shuffle_window`` = every row group; the default would only
   permute the windows, one row group each), ``train.epochs`` = each of ``--passes``; its data
   set (files hard-linked from the windows) has window ``N-2`` as eval split, a second one
   window ``N-1``; the final model is exported and scored on both (``gem score``). At window
   ``N-2`` the streaming model has seen exactly the same requests (once, oldest first); at
   ``N-1`` it has also seen ``N-2``.

Both train with the same batch size and a constant learning rate after the same warm-up, and the
shuffled runs evaluate only at their end (``train.eval_every = 0``), so no checkpoint is chosen by
its NE on the window it is scored on. Then it prints one Markdown table per task: per window the
achievable NE (the true probabilities), the stale NE (window 0's process), the streaming
progressive NE and the shuffled-past NEs. Runs already finished under ``--out`` are reused (their
directories name the seed).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

GEM = str(Path(sys.executable).with_name("gem"))
TASKS = ("click", "conversion")
COMMON = ("--preset", "tiny", "--no-progress", "--set", "data.source=parquet",
          "--set", "train.batch_size=256", "--set", "train.steps=100000")


def gem(*args: str) -> None:
    print("+ gem", shlex.join(args), flush=True)
    subprocess.run([GEM, *args], check=True)


def sets(**overrides: object) -> list[str]:
    return [arg for key, value in overrides.items()
            for arg in ("--set", f"{key.replace('__', '.')}={value}")]


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def past_data_set(windows: Path, out: Path, past: int, target: int) -> Path:
    """A data set in ``out`` (files hard-linked from ``windows``) whose train split is windows
    ``0 .. past-1`` and whose eval split is window ``target``."""
    from gem_data.manifest import Manifest, checked, read_manifest, write_manifest

    source = read_manifest(windows)
    entries = {entry.path: entry for entry in source.splits["train"]}
    split = {"train": [p for w in source.windows[:past] for p in w.files],
             "eval": list(source.windows[target].files)}
    for path in (p for paths in split.values() for p in paths):
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        if not (out / path).exists():
            os.link(windows / path, out / path)
    info = {"source": "tools/measure_streaming.py", "from": str(windows),
            "train_windows": [w.name for w in source.windows[:past]],
            "eval_window": source.windows[target].name}
    manifest = Manifest(schema=source.schema, info=info, splits={
        name: tuple(entries[p] for p in paths) for name, paths in split.items()})
    write_manifest(out, checked(out, manifest))
    return out


def train(out: Path, *args: str) -> dict:
    if not (out / "summary.json").is_file():
        gem("train", "--out", str(out), *COMMON, *args)
    return read_json(out / "summary.json")


def score(run: Path, data: Path) -> dict[str, dict]:
    """Per task, the report (NE, AUC, calibration, ...) of ``run``'s final model on the eval
    split of ``data``: ``gem export-model``, then ``gem score`` (the same figures as the
    trainer's evaluation, to about 1e-9)."""
    export, scores = run / "export", run / f"score-{data.name}"
    if not (export / "manifest.json").is_file():
        gem("export-model", str(run), "--out", str(export))
    if not (scores / "score.json").is_file():
        gem("score", str(export), "--data", str(data), "--out", str(scores))
    metrics = read_json(scores / "score.json")["splits"]["eval"]["metrics"]
    return {task: metrics[task] for task in TASKS}


def fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.4f}"


def cell(report: dict | None) -> str:
    """NE (AUC, calibration) of one task's report; empty without one."""
    if report is None:
        return ""
    return f"{report['ne']:.4f} ({report['auc']:.3f}, {report['calibration']:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True,
                        help="scratch directory (one per --windows and --window-rows)")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--window-rows", type=int, default=5000)
    parser.add_argument("--passes", type=int, nargs="+", default=[1, 3],
                        help="train.epochs of the shuffled-past runs")
    parser.add_argument("--seed", type=int, default=0,
                        help="train.seed of every run (the data set's seed is 0)")
    args = parser.parse_args()
    out, count, rows = args.out.resolve(), args.windows, args.window_rows
    if count < 3:
        parser.error("--windows must be at least 3 (a past and two windows after it)")
    out.mkdir(parents=True, exist_ok=True)
    windows = out / "windows"
    if not (windows / "manifest.json").is_file():
        gem("data", "synth", "--out", str(windows), "--windows", str(count),
            "--window-rows", str(rows), "--seed", "0")
    info = [w["info"] for w in read_json(windows / "manifest.json")["windows"]]
    run_sets = sets(data__eval_rows=rows, train__seed=args.seed)

    stream = train(out / f"stream-seed{args.seed}", *sets(data__path=windows, data__order="time",
                                         data__options="{}"), *run_sets)
    progressive = {w["window_index"]: {t: w[t] for t in TASKS}
                   for w in stream["progressive"]["windows"]}

    past, targets = count - 2, (count - 2, count - 1)
    data = {t: past_data_set(windows, out / f"past-eval-{t}", past, t) for t in targets}
    # rows of every row group of the past shuffled together: not only the windows' order
    groups = sum(len(f["row_groups"])
                 for f in read_json(data[past] / "manifest.json")["splits"]["train"]["files"])
    shuffled: dict[int, dict[int, dict[str, dict]]] = {}
    for passes in args.passes:
        run = out / f"shuffled-{passes}-seed{args.seed}"
        summary = train(run, *sets(data__path=data[past], train__epochs=passes,
                                   data__options=f"{{shuffle_window = {groups}}}",
                                   train__lr_schedule="constant", train__eval_every=0),
                        *run_sets)
        shuffled[passes] = {t: score(run, data[t]) for t in targets}
        trained = ", ".join(f"{t} {summary['eval'][t]['ne']:.4f}" for t in TASKS)
        again = ", ".join(f"{t} {r['ne']:.4f}" for t, r in shuffled[passes][past].items())
        print(f"shuffled, {passes} pass(es): {summary['run']['steps']} steps, data_passes "
              f"{summary['run']['data_passes']}; on window {past}, the trainer's evaluation: "
              f"{trained}; gem score: {again}")

    print(f"\n{count} windows of {rows} requests; streaming: {stream['run']['steps']} steps; "
          f"shuffled past: windows 0-{past - 1}\n")
    for task in TASKS:
        head = ["window", "achievable", "stale (window 0)", "streaming (progressive)",
                *(f"shuffled past, {p} pass{'es' * (p > 1)}" for p in args.passes)]
        print(f"**{task}**: NE; the models' (AUC, calibration) in brackets\n\n"
              f"| {' | '.join(head)} |\n|{'---|' * len(head)}")
        for w in range(1, count):
            cells = [str(w), fmt(info[w]["achievable_ne"][task]), fmt(info[w]["stale_ne"][task]),
                     cell(progressive.get(w, {}).get(task)),
                     *(cell(shuffled[p].get(w, {}).get(task)) for p in args.passes)]
            print(f"| {' | '.join(cells)} |")
        print()


if __name__ == "__main__":
    main()
