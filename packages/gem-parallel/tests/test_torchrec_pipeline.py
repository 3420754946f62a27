"""``[parallel.embedding] pipeline``: TorchRec's train pipelines on 2 CPU ranks over gloo.

One torchrun launch (this file run as a script) trains, in the same two processes, with
``--embedding-sharding torchrec`` and DDP:

- ``none``: 6 steps, evaluated at steps 3 and 6, checkpoints every 2 steps;
- ``sparse-dist``: the same run through ``TrainPipelineSparseDist``;
- ``sparse-dist`` stopped after step 2 (``until_step``; the pipeline holds batches 3 and 4 then)
  and resumed to step 6;
- ``semi-sync``: 30 steps through ``TrainPipelineSemiSync``, evaluated every 10.

The tests read the run directories: the exact pipeline's losses, evaluations and checkpointed
data positions equal ``none``'s bit for bit, the resumed pipelined run equals the uninterrupted
one, and semi-sync (lookups one update late) learns.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from gem_core.testing.processes import run_process_group

BASE = ["backends.embedding_sharding=torchrec", "backends.dense_sharding=ddp",
        "train.batch_size=32", "data.eval_rows=256", "train.eval_batch_size=256",
        "train.warmup_steps=1", "data.max_seq_len=16", "model.interaction_dims=[16]"]
# (run name, pipeline, steps, eval_every, checkpoint_every, until_step, fresh)
RUNS = [
    ("none", "none", 6, 3, 2, None, True),
    ("sparse-dist", "sparse-dist", 6, 3, 2, None, True),
    ("resumed", "sparse-dist", 6, 3, 2, 2, True),
    ("resumed", "sparse-dist", 6, 3, 2, None, False),
    ("semi-sync", "semi-sync", 30, 10, 0, None, True),
]


def _worker(out_dir: str) -> None:
    import torch

    from gem_core.cli.main import CATALOG
    from gem_core.config.loading import load_config
    from gem_core.train.trainer import train

    torch.set_num_threads(1)
    for attempt, (name, pipeline, steps, eval_every, every, until, fresh) in enumerate(RUNS):
        # Each train() starts and ends its own process group: a fresh store prefix per group
        # (the trainer's prefix follows torchrun's restart count).
        os.environ["TORCHELASTIC_RESTART_COUNT"] = f"pipeline-test-{attempt}"
        config = load_config(overrides=[*BASE, f"parallel.embedding.pipeline={pipeline}",
                                        f"train.steps={steps}", f"train.eval_every={eval_every}",
                                        f"train.checkpoint_every={every}"])
        train(config, CATALOG.plugins, Path(out_dir) / name, fresh=fresh, progress=False,
              until_step=until)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pipeline")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--standalone", __file__, str(out)]
    result = run_process_group(command, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-5000:]
    return out


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


COUNTERS = ("step", "loss", "loss_click", "loss_conversion", "samples", "tokens", "grad_norm")


@pytest.mark.distributed
@pytest.mark.slow
def test_sparse_dist_pipeline_trains_exactly_as_without_it(runs):
    from gem_core.checkpoint.checkpointer import read_trainer_state

    plain, piped = runs / "none", runs / "sparse-dist"
    pipeline = _summary(piped)["embedding_sharding"]["pipeline"]
    assert pipeline == {"kind": "sparse-dist", "torchrec_class": "TrainPipelineSparseDist",
                        "pipelined_modules": ["ebc", "ec"]}
    assert "pipeline" not in _summary(plain)["embedding_sharding"]
    expected = [{k: m[k] for k in COUNTERS} for m in _lines(plain / "metrics.jsonl")]
    assert len(expected) == 6
    assert [{k: m[k] for k in COUNTERS} for m in _lines(piped / "metrics.jsonl")] == expected
    assert _lines(piped / "eval.jsonl") == _lines(plain / "eval.jsonl")
    # The pipeline had fetched two batches more than it trained at each save: the checkpoints
    # hold the position after the last batch trained, as the run without a pipeline does.
    for step in (4, 6):
        name = f"checkpoints/step-{step:08d}"
        assert read_trainer_state(piped / name)["data"] == \
            read_trainer_state(plain / name)["data"]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_stopped_pipelined_run_resumes_exactly(runs):
    resumed, whole = runs / "resumed", runs / "sparse-dist"
    assert _summary(resumed)["run"]["resumed_from"] == 2
    expected = [{k: m[k] for k in COUNTERS} for m in _lines(whole / "metrics.jsonl")]
    assert [{k: m[k] for k in COUNTERS} for m in _lines(resumed / "metrics.jsonl")] == expected
    # The stop evaluated at step 2 as well (a run evaluates where it ends).
    evaluations = _lines(resumed / "eval.jsonl")
    assert [e["step"] for e in evaluations] == [2, 3, 6]
    assert evaluations[1:] == _lines(whole / "eval.jsonl")


@pytest.mark.distributed
@pytest.mark.slow
def test_semi_sync_pipeline_learns(runs):
    run = runs / "semi-sync"
    assert _summary(run)["embedding_sharding"]["pipeline"]["torchrec_class"] == \
        "TrainPipelineSemiSync"
    losses = [m["loss"] for m in _lines(run / "metrics.jsonl")]
    assert len(losses) == 30
    # Measured: about 1.34 over the first 5 steps, 0.74 over the last 5.
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    evals = _lines(run / "eval.jsonl")
    assert [e["step"] for e in evals] == [10, 20, 30]
    for task in ("click", "conversion"):
        assert evals[-1][task]["ne"] < evals[0][task]["ne"]


@pytest.mark.slow
def test_bench_pipeline_times_each_pipeline_against_none():
    """``gem bench pipeline`` on one process (TorchRec in a group of one rank): the smallest
    real runs, checked for what the report holds, not for a speedup (CPU figures are noise)."""
    from click.testing import CliRunner

    from gem_parallel.bench_pipeline import pipeline

    result = CliRunner().invoke(pipeline, ["--ranks", "1", "--pipeline", "sparse-dist",
                                           "--repeats", "1", "--steps", "4",
                                           "--per-rank-batch", "8", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["ranks"] == 1 and report["steps_untimed"] == 3
    none, piped = report["pipelines"]
    assert [none["pipeline"], piped["pipeline"]] == ["none", "sparse-dist"]
    assert none["speedup_over_none"] == 1.0
    assert piped["speedup_over_none"] == pytest.approx(
        none["step_time_s_median"] / piped["step_time_s_median"])
    for row in (none, piped):
        assert len(row["step_time_s_runs"]) == 1 and row["step_time_s_median"] > 0
        # The loop's step time holds the trainer's step and the batch fetch around it.
        assert row["step_time_s_median"] >= row["trainer_step_time_s_median"]
    assert piped["final_loss"] == none["final_loss"]  # the exact pipeline, one process too


# -- refusals (no process group) ----------------------------------------------------------------

def test_an_unknown_pipeline_is_refused_naming_the_choices():
    from gem_core.errors import GemConfigError
    from gem_parallel.torchrec.plan import parse_options

    with pytest.raises(GemConfigError, match="parallel.embedding.pipeline") as error:
        parse_options({"pipeline": "async"})
    assert "'async'" in str(error.value)
    assert "sparse-dist" in str(error.value) and "semi-sync" in str(error.value)


@pytest.mark.parametrize("kind", ["sparse-dist", "semi-sync"])
def test_managed_tables_refuse_a_pipeline(kind):
    from types import SimpleNamespace

    from gem_core.errors import GemConfigError
    from gem_parallel.torchrec.pipeline import PipelinedSteps

    collection = SimpleNamespace(remappers={"ads": object(), "users": object()})
    with pytest.raises(GemConfigError, match=f"pipeline = '{kind}' cannot run with table"
                                             r"\(s\) ads, users of id_policy 'managed'"):
        PipelinedSteps(iter(()), collection, schema=None, ctx=None, kind=kind,
                       options=SimpleNamespace(layout="model_parallel"))


def test_semi_sync_refuses_the_2d_layout():
    from types import SimpleNamespace

    from gem_core.errors import GemConfigError
    from gem_parallel.torchrec.pipeline import PipelinedSteps

    with pytest.raises(GemConfigError, match="'semi-sync' cannot run with layout = '2d'"):
        PipelinedSteps(iter(()), SimpleNamespace(remappers={}), schema=None, ctx=None,
                       kind="semi-sync", options=SimpleNamespace(layout="2d"))


if __name__ == "__main__":
    _worker(sys.argv[1])
