"""Resharding on resume: a checkpoint written by 2 ranks under FSDP2 loads into 1 process and into
4 ranks. The loaded model evaluates exactly as before the stop, and training continues with the
same global batches as an uninterrupted 2-rank run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gem_core.checkpoint.resume import MODEL_FORMAT, check_compatible
from gem_core.config import load_config, unstructure
from gem_core.errors import GemConfigError

SMALL = ["--set", "train.steps=8", "--set", "train.batch_size=32", "--set", "data.eval_rows=256",
         "--set", "train.eval_batch_size=256", "--set", "train.warmup_steps=2",
         "--set", "train.eval_every=0", "--set", "train.checkpoint_every=4",
         "--set", "data.max_seq_len=24", "--set", "model.interaction_dims=[16]",
         "--no-progress"]
TWO_FSDP2 = ["--nproc-per-node", "2", "--sharding", "fsdp2"]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(gem, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reshard")
    whole, stopped = root / "whole", root / "stopped"
    for out, extra in ((whole, []), (stopped, ["--until-step", "4"])):
        result = gem("train", "--out", str(out), *TWO_FSDP2, *extra, *SMALL)
        assert result.returncode == 0, result.stderr[-3000:]
    return {"whole": whole, "stopped": stopped}


@pytest.mark.distributed
@pytest.mark.parametrize("launch", [
    pytest.param(["--sharding", "none"], id="1-rank"),
    pytest.param(["--nproc-per-node", "4", "--sharding", "fsdp2"], id="4-ranks-fsdp2"),
])
def test_two_rank_fsdp2_checkpoint_resumes_on_another_number_of_ranks(gem, tmp_path, runs,
                                                                      launch):
    out = tmp_path / "resumed"
    shutil.copytree(runs["stopped"], out)
    result = gem("train", "--out", str(out), *launch, *SMALL)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resharded from 2 to" in result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["resumed_from"] == 4 and summary["run"]["finished"]
    assert summary["run"]["world_size"] == (4 if "4" in launch else 1)

    # Predictions before and after: the evaluation saved at step 4 (2 ranks) and the one run
    # right after loading on the new number of ranks are the same.
    at_stop = [e for e in summary["eval_history"] if e["step"] == 4]
    assert len(at_stop) == 2
    for task in ("click", "conversion"):
        assert at_stop[1][task]["ne"] == pytest.approx(at_stop[0][task]["ne"], rel=1e-6, abs=0)
        assert at_stop[1][task]["auc"] == pytest.approx(at_stop[0][task]["auc"], rel=1e-6)

    # The data stream continued at the same global batch: the same samples and history tokens
    # at every step as the uninterrupted 2-rank run, and losses equal up to float summation
    # order across a different number of ranks.
    whole, got = _metrics(runs["whole"]), _metrics(out)
    assert [m["step"] for m in got] == list(range(1, 9))
    assert [(m["samples"], m["tokens"]) for m in got] == \
        [(m["samples"], m["tokens"]) for m in whole]
    for a, b in zip(whole[4:], got[4:], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)


@pytest.fixture(scope="module")
def parquet_data(tmp_path_factory) -> Path:
    from click.testing import CliRunner

    from gem_data.cli import data_group

    data = tmp_path_factory.mktemp("parquet") / "data"
    synth = CliRunner().invoke(data_group, ["synth", "--out", str(data), "--rows", "512",
                                            "--eval-rows", "256", "--row-group-rows", "64"])
    assert synth.exit_code == 0, synth.output[-3000:]
    return data


def _parquet(data: Path, sharding: str) -> list[str]:
    return ["--data", "parquet", "--set", f"data.path={data}",
            "--set", f"data.options.sharding={sharding}", "--set", "data.options.prefetch=0"]


@pytest.mark.distributed
def test_parquet_global_position_continues_on_another_number_of_ranks(gem, tmp_path,
                                                                      parquet_data):
    """Parquet with ``sharding = 'global'``: every rank streams the same global order, so the
    saved position is global and one process continues at the same global batch."""
    parquet = _parquet(parquet_data, "global")
    whole, out = tmp_path / "whole", tmp_path / "run"
    assert gem("train", "--out", str(whole), *parquet, *SMALL).returncode == 0
    first = gem("train", "--out", str(out), *TWO_FSDP2, "--until-step", "4", *parquet, *SMALL)
    assert first.returncode == 0, first.stderr[-3000:]
    again = gem("train", "--out", str(out), *parquet, *SMALL)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["run"]["resumed_from"] == 4
    assert [(m["samples"], m["tokens"]) for m in _metrics(out)] == \
        [(m["samples"], m["tokens"]) for m in _metrics(whole)]


@pytest.mark.distributed
def test_per_rank_data_positions_refuse_another_number_of_ranks(gem, tmp_path, parquet_data):
    """Parquet with ``sharding = 'row_groups'``: each rank reads its own row groups, so its
    position means nothing to another number of ranks; the resume names the source."""
    parquet = _parquet(parquet_data, "row_groups")
    out = tmp_path / "run"
    first = gem("train", "--out", str(out), *TWO_FSDP2, "--until-step", "2", *parquet, *SMALL)
    assert first.returncode == 0, first.stderr[-3000:]
    again = gem("train", "--out", str(out), *parquet, *SMALL)
    assert again.returncode != 0
    assert ("data source 'parquet' saved a different position on each rank" in again.stderr
            and "resume with 2 ranks" in again.stderr), again.stderr[-3000:]
    assert "Traceback" not in again.stderr


def _saved(config, **changes) -> dict:
    state = {"config": unstructure(config), "dense_sharding": "fsdp2", "format": "dcp",
             "world_size": 2, "model_format": MODEL_FORMAT}
    return {**state, **changes}


def test_what_a_resume_refuses_and_what_it_allows(tmp_path):
    config = load_config()
    # DCP checkpoints load into any DCP engine and number of ranks.
    check_compatible(_saved(config), tmp_path, config=config, strategy="none",
                     engine_format="dcp", world_size=1)
    with pytest.raises(GemConfigError, match=r"holds the model and optimizer as 'dcp'.*"
                                             r"'deepspeed-zero3' needs 'full'"):
        check_compatible(_saved(config), tmp_path, config=config, strategy="deepspeed-zero3",
                         engine_format="full", world_size=2)
    full = _saved(config, format="full", dense_sharding="deepspeed-zero3")
    with pytest.raises(GemConfigError, match="written by 2 ranks and this run has 4.*cannot be "
                                             "resharded"):
        check_compatible(full, tmp_path, config=config, strategy="deepspeed-zero3",
                         engine_format="full", world_size=4)
    with pytest.raises(GemConfigError, match="written with dense sharding 'deepspeed-zero3'"):
        check_compatible(full, tmp_path, config=config, strategy="deepspeed-zero1",
                         engine_format="full", world_size=2)
    with pytest.raises(GemConfigError, match=r"older GEM trainer \(model format 1"):
        legacy = {k: v for k, v in _saved(config).items() if k != "model_format"}
        check_compatible(legacy, tmp_path, config=config, strategy="none", engine_format="dcp",
                         world_size=1)
    with pytest.raises(GemConfigError, match="another feature schema"):
        check_compatible(_saved(config, schema={"tasks": ["other"]}), tmp_path, config=config,
                         strategy="none", engine_format="dcp", world_size=1,
                         schema={"tasks": ["click"]})
    other = load_config(overrides=["model.num_layers=1"])
    with pytest.raises(GemConfigError, match=r"different \[model\] \(num_layers\)"):
        check_compatible(_saved(other), tmp_path, config=config, strategy="fsdp2",
                         engine_format="dcp", world_size=2)
