"""End-to-end training throughput and local MFU on one GPU: the E2E part of ``tools/gpu_check.sh``.

For ``small`` and a shortened ``large`` (fewer layers, smaller batch and data; see ``PLANS``) it
trains a few steps with the real trainer (``gem_core.train.train``) in each compile mode
(``eager``; ``compiled``: ``train.compile``; ``cudagraphs``: ``train.compile_mode =
"reduce-overhead"``) under ``bf16`` and ``fp8-auto``, with the ``fbgemm-tbe`` embeddings when
fbgemm_gpu is importable (else ``reference``, recorded with the reason; ``--embedding`` names
one explicitly). Each run is its own subprocess with its own time limit, so a crash, a hang or a
missing package fails that run only; runs the time budget cannot fit are listed as skipped.

From each run's ``summary.json``: samples and tokens per second and local MFU at the median step
(the trainer excludes the first steps, where compilation happens), MFU always against the
measured bf16 matmul peak (``gem_core.train.peak``), so FP8 gains show as MFU above what bf16
could reach; the first step's compile seconds; the final NE per task, and for ``fp8-auto`` its
drift from the ``bf16`` run of the same preset and mode (same seed, same batches).

    python -m gem_kernels.bench.gpu_e2e plan [--size full|tiny] [--device cuda|cpu]
    python -m gem_kernels.bench.gpu_e2e run --out E2E.json --workdir DIR [--budget-s S] ...

``plan`` validates every planned configuration (keys, values, registered names) without
training. ``--device cpu --size tiny`` (the CI dry run) trains only the eager bf16 run of
``tiny`` (compiling a model takes minutes on a small CPU; CUDA graphs need CUDA) and validates
the others.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

COMMON = ("train.eval_every=0", "train.log_every=1", "train.checkpoint_every=0",
          "train.warmup_steps=2")
PLANS: dict[str, dict[str, tuple[str, ...]]] = {
    # preset -> overrides; WARMUP_STEPS_EXCLUDED of the trainer are left out of the timing.
    "full": {
        "small": ("train.steps=14", "train.batch_size=256", "data.eval_rows=4096",
                  "train.eval_batch_size=4096"),
        "large": ("train.steps=12", "train.batch_size=256", "model.num_layers=4",
                  "model.wukong_layers=4", "data.max_seq_len=4096", "data.eval_rows=2048",
                  "train.eval_batch_size=2048", "data.options.num_items=200000",
                  "data.options.num_users=100000"),
    },
    "tiny": {
        "tiny": ("train.steps=3", "train.batch_size=8", "data.eval_rows=32",
                 "train.eval_batch_size=32", "data.max_seq_len=16", "model.embedding_dim=16",
                 "model.interaction_dims=[16]"),
    },
}
MODES = {"eager": (), "compiled": ("train.compile=true",),
         "cudagraphs": ("train.compile=true", "train.compile_mode=reduce-overhead")}
PRECISIONS = ("bf16", "fp8-auto")
PER_RUN_LIMIT_S = {"full": 150, "tiny": 240}


def default_embedding() -> tuple[str, str]:
    if importlib.util.find_spec("fbgemm_gpu") is not None:
        return "fbgemm-tbe", "fbgemm_gpu is importable"
    return "reference", "fbgemm_gpu is not importable here (the GPU image cannot carry it)"


def plan(size: str, device: str, embedding: str) -> list[dict[str, Any]]:
    """Every run, most telling first (so a cut budget loses the least): eager bf16 of each
    preset, then compiled, fp8-auto, CUDA graphs."""
    order = [("eager", "bf16"), ("compiled", "bf16"), ("eager", "fp8-auto"),
             ("compiled", "fp8-auto"), ("cudagraphs", "bf16"), ("cudagraphs", "fp8-auto")]
    runs = []
    for mode, precision in order:
        for preset, overrides in PLANS[size].items():
            runnable = device == "cuda" or (mode, precision) == ("eager", "bf16")
            runs.append({
                "name": f"{preset}/{mode}/{precision}", "preset": preset, "mode": mode,
                "precision": precision, "runnable": runnable,
                "overrides": [*COMMON, *overrides, *MODES[mode], f"train.device={device}",
                              f"backends.precision={precision}",
                              f"backends.embedding={embedding}"],
            })
    return runs


def build_run_plugins():
    """gem-core's plugins plus gem-kernels' and gem-precision's, registered from their modules
    (the GPU image has this checkout on PYTHONPATH, not installed entry points)."""
    from gem_core.plugins import build_plugins

    extra = [(name, importlib.import_module(module))
             for name, module in (("gem-kernels", "gem_kernels.plugin"),
                                  ("gem-precision", "gem_precision.plugin"))
             if importlib.util.find_spec(module.split(".")[0]) is not None]
    return build_plugins(load_entry_points=False, extra_plugins=extra)


def validate(run: dict[str, Any], plugins: Any) -> None:
    """The configuration loads and every backend it names is registered (nothing trains)."""
    from gem_core.config import load_config

    config = load_config(preset=run["preset"], overrides=run["overrides"])
    for kind, name in (("precision", config.backends.precision),
                       ("embedding", config.backends.embedding)):
        plugins.registry(kind).get(name)


def train_one(preset: str, overrides: list[str], run_dir: str) -> None:
    from gem_core.config import load_config
    from gem_core.train.trainer import train

    config = load_config(preset=preset, overrides=overrides)
    train(config, build_run_plugins(), Path(run_dir), fresh=True, progress=False)


def _figures(summary: dict[str, Any]) -> dict[str, Any]:
    throughput, mfu = summary["throughput"], summary["mfu"]
    return {
        "samples_per_s": throughput["samples_per_s"], "tokens_per_s": throughput["tokens_per_s"],
        "step_ms": 1e3 * throughput["step_time_s_median"], "steps_timed": throughput["steps_timed"],
        "local_mfu": mfu["local"], "peak_flops": mfu["peak_flops_per_device"],
        "flops_per_step": summary["flops"]["per_step"],
        "ne": {task: report["ne"] for task, report in summary["eval"].items()},
        "compile": summary.get("compile"), "backends": {
            k: v["name"] for k, v in summary["backends"].items()},
    }


def ne_drift(results: dict[str, Any]) -> dict[str, Any]:
    """fp8-auto's final NE minus bf16's, per preset and mode where both finished."""
    drift = {}
    for name, row in results.items():
        preset, mode, precision = name.split("/")
        base = results.get(f"{preset}/{mode}/bf16", {})
        if precision != "bf16" and "ne" in row and "ne" in base:
            drift[name] = {task: row["ne"][task] - base["ne"][task] for task in row["ne"]}
    return drift


def table(report: dict[str, Any]) -> str:
    lines = [f"e2e embedding {report['embedding']} ({report['embedding_reason']})"]
    for name, row in report["runs"].items():
        if "samples_per_s" in row:
            mfu = row["local_mfu"]
            ne = statistics.fmean(row["ne"].values())
            lines.append(f"e2e {name}: {row['samples_per_s']:.0f} samples/s, "
                         f"{row['step_ms']:.1f} ms/step, local MFU "
                         f"{100 * mfu if mfu is not None else float('nan'):.2f} %, NE {ne:.4f}")
        else:
            lines.append(f"e2e {name}: {row.get('error') or row.get('skipped')}")
    for name, per_task in report["ne_drift"].items():
        lines.append(f"e2e NE drift {name} - bf16: " + ", ".join(
            f"{task} {value:+.4f}" for task, value in per_task.items()))
    return "\n".join(lines)


def run_all(args: argparse.Namespace) -> int:
    embedding, reason = ((args.embedding, "named with --embedding") if args.embedding
                         else default_embedding())
    runs = plan(args.size, args.device, embedding)
    plugins = build_run_plugins()
    report: dict[str, Any] = {"device": args.device, "size": args.size, "embedding": embedding,
                              "embedding_reason": reason, "runs": {}, "ne_drift": {},
                              "failed": []}
    deadline = time.monotonic() + args.budget_s
    workdir = Path(args.workdir)
    for run in runs:
        row: dict[str, Any] = {"overrides": run["overrides"]}
        report["runs"][run["name"]] = row
        try:
            validate(run, plugins)
        except Exception as error:  # a bad configuration fails this run only
            row["error"] = f"invalid configuration: {type(error).__name__}: {error}"[:1500]
            report["failed"].append(run["name"])
            continue
        left = deadline - time.monotonic()
        if not run["runnable"]:
            row["skipped"] = f"validated only (on {args.device} only eager bf16 trains)"
            continue
        if left < 30:
            row["skipped"] = f"time budget ({args.budget_s:.0f} s) spent"
            continue
        run_dir = workdir / run["name"].replace("/", "-")
        command = [sys.executable, "-m", "gem_kernels.bench.gpu_e2e", "one", "--preset",
                   run["preset"], "--run-dir", str(run_dir), *run["overrides"]]
        started = time.monotonic()
        try:
            done = subprocess.run(command, capture_output=True, text=True,
                                  timeout=min(left, PER_RUN_LIMIT_S[args.size]))
            if done.returncode != 0:
                raise RuntimeError(f"exit status {done.returncode}: {done.stderr[-1500:]}")
            row.update(_figures(json.loads((run_dir / "summary.json").read_text())))
        except Exception as error:  # one broken run must not hide the others' results
            row["error"] = f"{type(error).__name__}: {error}"[-2000:]
            report["failed"].append(run["name"])
        row["wall_s"] = time.monotonic() - started
        print(f"e2e {run['name']} done in {row['wall_s']:.0f} s"
              + (" (FAILED)" if "error" in row else ""), file=sys.stderr)
        report["ne_drift"] = ne_drift(report["runs"])
        Path(args.out).write_text(json.dumps(report, indent=1))
    report["ne_drift"] = ne_drift(report["runs"])
    Path(args.out).write_text(json.dumps(report, indent=1))
    for name in report["failed"]:
        print(f"FAIL e2e {name}: {report['runs'][name]['error'].splitlines()[0][:300]}",
              file=sys.stderr)
    print(table(report))
    return 1 if report["failed"] else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("plan", "run"):
        p = sub.add_parser(name)
        p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
        p.add_argument("--size", default="full", choices=sorted(PLANS))
        p.add_argument("--embedding", default=None,
                       help="embedding backend (default: fbgemm-tbe when importable)")
        if name == "run":
            p.add_argument("--out", required=True, help="the JSON report")
            p.add_argument("--workdir", required=True, help="run directories go here")
            p.add_argument("--budget-s", type=float, default=270.0,
                           help="no run starts after this many seconds")
    one = sub.add_parser("one", help="train one planned run (what `run` starts per run)")
    one.add_argument("--preset", required=True)
    one.add_argument("--run-dir", required=True)
    one.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.command == "one":
        train_one(args.preset, args.overrides, args.run_dir)
        return 0
    if args.command == "run":
        return run_all(args)
    embedding = args.embedding or default_embedding()[0]
    plugins = build_run_plugins()
    for run in plan(args.size, args.device, embedding):
        validate(run, plugins)
        print(f"{run['name']}: {'train' if run['runnable'] else 'validate'} "
              f"{run['preset']} {' '.join(run['overrides'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
