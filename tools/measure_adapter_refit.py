"""The Student Adapter refitted on each most recent window against fitted once (issue #27,
item 4), on a drifting synthetic log.

``python tools/measure_adapter_refit.py --out /tmp/refit`` runs, through the ``gem`` CLI:

1. ``gem data synth --windows N --window-rows R``: a drifting log of N windows (days);
2. the **teacher**: ``tiny`` in time order over windows ``0 .. K-1`` only (a data set of their
   files, hard-linked), so it is stale on every later window;
3. four **students**, ``tiny`` in time order over windows ``K .. N-1`` (another such data set),
   each window evaluated before the student trains on it (progressive NE): trained alone (no
   teacher), distilled from the teacher without the adapter, with the adapter fitted once (on
   the student's first window, ``distill.adapter.refit = once``), and with the adapter refitted
   before each window on the window before (``refit = each_window``). The adapter is fitted on
   ``R // batch`` batches (about the whole window), 5 Adam passes (the default).

It prints one Markdown table per task: per evaluated window the achievable NE (the true
probabilities), the stale NE (window 0's process), the teacher's NE on the window raw and
through each adapter (``summary.json["distill"]["windows"]``: the adapter of that window, fitted
on earlier data only), and each student's progressive NE; the last row is the mean over the
windows. Runs already finished under ``--out`` are reused (their directories name the seed).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

GEM = str(Path(sys.executable).with_name("gem"))
TASKS = ("click", "conversion")
BATCH = 256
COMMON = ("--preset", "tiny", "--no-progress", "--set", "data.source=parquet",
          "--set", "data.order=time", "--set", "data.options={}",
          "--set", f"train.batch_size={BATCH}", "--set", "train.steps=100000")
STUDENTS = {  # name -> (gem command, extra options)
    "alone": ("train", ()),
    "no adapter": ("distill", ()),
    "adapter once": ("distill", ("--adapter", "--set", "distill.adapter.refit=once")),
    "adapter each window": ("distill", ("--adapter", "--set",
                                        "distill.adapter.refit=each_window")),
}


def gem(*args: str) -> None:
    print("+ gem", shlex.join(args), flush=True)
    subprocess.run([GEM, *args], check=True)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def window_subset(windows: Path, out: Path, first: int, stop: int) -> Path:
    """A data set in ``out`` (files hard-linked from ``windows``) of windows ``first .. stop-1``:
    their files are its train split, the windows its windows (without the state files an append
    reads: nothing is appended to it)."""
    import attrs

    from gem_data.manifest import Manifest, checked, read_manifest, write_manifest

    if (out / "manifest.json").is_file():
        return out
    source = read_manifest(windows)
    kept = [attrs.evolve(w, state=()) for w in source.windows[first:stop]]
    entries = {entry.path: entry for entry in source.splits["train"]}
    files = [path for w in kept for path in w.files]
    for path in files:
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        if not (out / path).exists():
            os.link(windows / path, out / path)
    info = {"source": "tools/measure_adapter_refit.py", "from": str(windows),
            "windows": [w.name for w in kept]}
    manifest = Manifest(schema=source.schema, info=info, windows=kept,
                        splits={"train": tuple(entries[p] for p in files)})
    write_manifest(out, checked(out, manifest))
    return out


def run(command: str, out: Path, *args: str) -> dict:
    if not (out / "summary.json").is_file():
        gem(command, "--out", str(out), *COMMON, *args)
    return read_json(out / "summary.json")


def fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.4f}"


def mean(values: list[float | None]) -> float | None:
    return None if not values or None in values else statistics.fmean(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True,
                        help="scratch directory (one per --windows, --window-rows, --teacher-"
                             "windows)")
    parser.add_argument("--windows", type=int, default=10)
    parser.add_argument("--window-rows", type=int, default=4000)
    parser.add_argument("--teacher-windows", type=int, default=4,
                        help="the teacher trains on windows 0 .. K-1, the students on the rest")
    parser.add_argument("--seed", type=int, default=0,
                        help="train.seed of every run (the data set's seed is 0)")
    args = parser.parse_args()
    out, count, rows, k = args.out.resolve(), args.windows, args.window_rows, args.teacher_windows
    if not 1 <= k <= count - 2:
        parser.error("--teacher-windows must leave the students at least 2 windows")
    out.mkdir(parents=True, exist_ok=True)
    windows = out / "windows"
    if not (windows / "manifest.json").is_file():
        gem("data", "synth", "--out", str(windows), "--windows", str(count),
            "--window-rows", str(rows), "--seed", "0")
    info = [w["info"] for w in read_json(windows / "manifest.json")["windows"]]
    # The whole window is each progressive evaluation and (about) each adapter fit.
    run_sets = ("--set", f"data.eval_rows={rows}", "--set", f"train.seed={args.seed}")
    fit = ("--set", f"distill.adapter.fit_batches={max(rows // BATCH, 1)}")

    teacher_data = window_subset(windows, out / "teacher-data", 0, k)
    student_data = window_subset(windows, out / "student-data", k, count)
    teacher = out / f"teacher-seed{args.seed}"
    run("train", teacher, "--set", f"data.path={teacher_data}", *run_sets)
    summaries = {}
    for name, (command, extra) in STUDENTS.items():
        directory = out / f"student-{name.replace(' ', '-')}-seed{args.seed}"
        teacher_args = ("--teacher", str(teacher), *fit) if command == "distill" else ()
        summaries[name] = run(command, directory, "--set", f"data.path={student_data}",
                              *teacher_args, *extra, *run_sets)

    # Window indices below are the full log's: the students' window i is window k + i.
    progressive = {name: {k + w["window_index"]: w for w in s["progressive"]["windows"]}
                   for name, s in summaries.items()}
    teacher_ne = {name: {k + r["window_index"]: r["teacher_ne"]
                         for r in s["distill"]["windows"]}
                  for name, s in summaries.items() if "distill" in s}
    evaluated = sorted(progressive["alone"])
    steps = {name: s["run"]["steps"] for name, s in summaries.items()}
    print(f"\n{count} windows of {rows} requests; teacher: windows 0-{k - 1} "
          f"({read_json(teacher / 'summary.json')['run']['steps']} steps); students: windows "
          f"{k}-{count - 1} ({steps['alone']} steps), each evaluated before training on it\n")
    for task in TASKS:
        head = ["window", "achievable", "stale (window 0)", "teacher raw",
                "teacher + adapter once", "teacher + adapter each window",
                *(f"student: {name}" for name in STUDENTS)]
        print(f"**{task}**: NE on the window before training on it\n\n"
              f"| {' | '.join(head)} |\n|{'---|' * len(head)}")
        columns: list[list[float | None]] = [[] for _ in head[1:]]
        for w in evaluated:
            values = [info[w]["achievable_ne"][task], info[w]["stale_ne"][task],
                      teacher_ne["no adapter"][w]["raw"][task],
                      teacher_ne["adapter once"][w]["adapted"][task],
                      teacher_ne["adapter each window"][w]["adapted"][task],
                      *(progressive[name][w][task]["ne"] for name in STUDENTS)]
            for column, value in zip(columns, values):
                column.append(value)
            print(f"| {w} | {' | '.join(fmt(v) for v in values)} |")
        print(f"| mean | {' | '.join(fmt(mean(c)) for c in columns)} |\n")
    refits = summaries["adapter each window"]["distill"]["windows"]
    print("each-window refits (fit data's NE before -> after, click / conversion):")
    for record in refits:
        a = record["adapter_fit"]
        print(f"  window {k + record['window_index']} fitted on {k + a['window_index']} "
              f"({a['rows']} requests): " + ", ".join(
                  f"{t} {fmt(a['ne_before'][t])} -> {fmt(a['ne_after'][t])}" for t in TASKS))


if __name__ == "__main__":
    main()
