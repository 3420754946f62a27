"""A finished run exits cleanly: short 2-rank TorchRec (with a background checkpoint) and DeepSpeed
(with TorchRec tables) runs, repeated under a concurrent CPU load, all exit 0 and none aborts at
exit ("terminate called ..."). Every background thread (the loader's prefetch, DCP's checkpoint
writer, TensorBoard's writer) is joined before the process group is destroyed
(gem_core.train.teardown).

Each kind runs ``GEM_TEARDOWN_REPEATS`` times (default 1: two short runs beside a busy process
cost about 26 s on 2 idle cores); set it higher to stress (docs/reliability.md gives the figure
measured with 20 each).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gem_core.testing.processes import run_process_group

REPEATS = int(os.environ.get("GEM_TEARDOWN_REPEATS", "1"))
SHORT = ["--preset", "tiny", "--nproc-per-node", "2", "--set", "train.steps=2",
         "--set", "train.batch_size=32", "--set", "data.eval_rows=64",
         "--set", "train.eval_batch_size=64", "--set", "train.warmup_steps=1",
         "--set", "train.eval_every=1", "--set", "train.checkpoint_every=1",
         "--set", "data.max_seq_len=16", "--no-progress"]
KINDS = {
    # DCP checkpoints written in the background: DCP's writer thread runs collectives on the
    # checkpointer's own group up to the end of the run.
    "torchrec": ["--embedding-sharding", "torchrec", "--set", "train.async_checkpoint=true"],
    # DeepSpeed keeps TorchRec's tables in a DCP directory beside its engine.pt: the finished
    # run is also reopened through load_run (export, scoring and distillation read it that way).
    "deepspeed": ["--sharding", "deepspeed-zero1", "--embedding-sharding", "torchrec"],
}
ENV = {**os.environ, "TORCH_EXTENSIONS_DIR": os.environ.get(
    "TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".cache/torch_extensions"))}


@pytest.fixture(scope="module")
def cpu_load():
    """A busy process competing with the ranks for the CPUs for the whole test, as the rest of
    a CI run does (the abort this guards against was seen only under load)."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield
    busy.kill()
    busy.wait()


@pytest.mark.distributed
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_short_multi_rank_runs_exit_cleanly_under_load(cpu_load, tmp_path, kind):
    failures = []
    for repeat in range(REPEATS):
        out = tmp_path / f"run-{repeat}"
        command = [sys.executable, "-m", "gem_core.cli.main", "train", "--out", str(out),
                   *SHORT, *KINDS[kind]]
        result = run_process_group(command, timeout=600, env=ENV)
        aborted = "terminate called" in result.stderr or "SIGABRT" in result.stderr
        if result.returncode != 0 or aborted:
            failures.append(f"repeat {repeat}: exit {result.returncode}\n"
                            f"{result.stderr[-3000:]}")
            continue
        summary = json.loads((out / "summary.json").read_text())
        assert summary["run"]["finished"] and summary["run"]["world_size"] == 2
        assert summary["checkpoints"]["kept_steps"][-1] == 2
        if kind == "deepspeed" and repeat == 0:
            _check_reopened_model_predicts_the_last_evaluation(out)
    assert not failures, f"{len(failures)} of {REPEATS} {kind} runs failed:\n" + "\n".join(
        failures)


def _check_reopened_model_predicts_the_last_evaluation(run_dir: Path) -> None:
    """``load_run`` rebuilds the 2-rank DeepSpeed + TorchRec model in one process: the dense
    weights from engine.pt and the tables from the DCP directory beside it, every one used."""
    from gem_core.testing.runs import assert_reproduces_last_evaluation
    from gem_core.trained_run import load_run

    run = load_run(run_dir)
    assert run.step == 2 and (run.checkpoint / "sharded").is_dir()
    assert_reproduces_last_evaluation(run, run_dir)


@pytest.mark.parametrize("ending, status", [("sys.exit(3)", 3), ("raise KeyError('boom')", 1)])
def test_a_rank_exits_with_its_status_flushed_and_without_finalization(ending, status):
    """What ``gem_core.rank_exit.run_then_exit`` promises a rank: its command's status, its
    output flushed, and no interpreter finalization (an atexit hook never runs)."""
    script = ("import atexit, sys\n"
              "from gem_core.rank_exit import run_then_exit\n"
              "atexit.register(lambda: print('finalized'))\n"
              "print('written', end='')\n"
              f"def command():\n    {ending}\n"
              "run_then_exit(command)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={**os.environ, "WORLD_SIZE": "2"}, timeout=120)
    assert result.returncode == status
    assert result.stdout == "written"  # flushed; 'finalized' never printed
    assert ("KeyError: 'boom'" in result.stderr) == (status == 1)
