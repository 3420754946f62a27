"""Verified checkpoints: every file's digest is recorded before the COMPLETE marker and checked
before anything loads. A damaged checkpoint is named and the run resumes from the newest one that
verifies (log warning + summary.json), which retention then never deletes; with none left the
run stops naming the options. ``gem checkpoints verify`` checks a run offline."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from gem_core.checkpoint.checkpointer import read_checkpoint
from gem_core.checkpoint.digests import verify_files
from gem_core.checkpoint.layout import complete_checkpoints
from gem_core.cli.main import cli
from gem_core.config import load_config
from gem_core.errors import GemCheckpointError
from gem_core.plugins import build_plugins
from gem_core.train.trainer import train

SMALL = ["train.steps=6", "train.batch_size=16", "data.eval_rows=128",
         "train.eval_batch_size=128", "train.warmup_steps=1", "train.eval_every=0",
         "train.checkpoint_every=2", "train.keep_checkpoints=3", "data.max_seq_len=16",
         "model.interaction_dims=[16]", "train.deterministic=true"]


def _train(run: Path, *extra: str, until_step: int | None = None):
    config = load_config(overrides=[*SMALL, *extra])
    return train(config, build_plugins(), run, progress=False, until_step=until_step)


def _step(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:08d}"


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in
            map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def flip_middle(path: Path, count: int = 64) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + count] = bytes(b ^ 0xFF for b in data[middle:middle + count])
    path.write_bytes(bytes(data))


def truncate_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A finished 6-step run with intact checkpoints of steps 2, 4 and 6."""
    run = tmp_path_factory.mktemp("verify") / "base"
    _train(run)
    assert [s for s, _ in complete_checkpoints(run)] == [2, 4, 6]
    return run


@pytest.fixture
def run(base, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(base, copy)
    return copy


def test_flipped_bytes_in_a_shard_fall_back_to_the_older_checkpoint(base, run, caplog):
    flip_middle(_step(run, 6) / "engine" / "__0_0.distcp")
    # Step 4 as a save killed after its COMPLETE marker, before the rename: a finished save,
    # which the next start publishes (not deletes as torn) and then resumes from.
    _step(run, 4).rename(run / "checkpoints" / ".tmp-step-00000004")
    with caplog.at_level(logging.WARNING):
        result = _train(run)
    warnings = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert "published" in warnings and "step-00000004" in warnings
    assert ("step-00000006 is damaged and is not loaded: engine/__0_0.distcp: content differs "
            "from its sha256 digest") in warnings
    assert result.summary["run"]["resumed_from"] == 4
    damaged = result.summary["checkpoints"]["damaged"]
    assert [(d["step"], d["problems"]) for d in damaged] == [
        (6, ["engine/__0_0.distcp: content differs from its sha256 digest"])]
    # Resumed exactly: steps 5 and 6 equal the uninterrupted run's, and the re-saved step 6
    # replaced the damaged copy.
    assert {s: _losses(run)[s] for s in (5, 6)} == {s: _losses(base)[s] for s in (5, 6)}
    assert verify_files(_step(run, 6)) == []
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step-00000002", "step-00000004", "step-00000006"]


def test_retention_never_deletes_the_newest_verified_checkpoint(run):
    written = json.loads((_step(run, 6) / "digests.json").read_text())["files"]["trainer.json"]
    (_step(run, 6) / "trainer.json").write_bytes(b"")  # 0 bytes
    (_step(run, 4) / "engine" / ".metadata").unlink()  # deleted
    # Keep one: the rotation alone would keep the damaged step 6 (the most recent) and delete
    # the step 4 this run writes.
    result = _train(run, "train.keep_checkpoints=1", "train.keep_best=false", until_step=4)
    assert result.summary["run"]["resumed_from"] == 2
    assert {d["step"]: d["problems"] for d in result.summary["checkpoints"]["damaged"]} == {
        6: [f"trainer.json: 0 bytes, written as {written['bytes']} (truncated or overwritten)"],
        4: ["engine/.metadata: missing"]}
    assert [s for s, _ in complete_checkpoints(run)] == [4, 6]
    assert verify_files(_step(run, 4)) == []
    assert read_checkpoint(_step(run, 4))["trainer"]["step"] == 4


def test_no_intact_checkpoint_stops_with_the_options(run):
    truncate_half(_step(run, 2) / "engine" / "__0_0.distcp")
    (_step(run, 4) / "trainer-tensors.pt").unlink()
    flip_middle(_step(run, 6) / "engine" / "__0_0.distcp")
    with pytest.raises(GemCheckpointError) as raised:
        _train(run)
    message = str(raised.value)
    for expected in ("step-00000002: engine/__0_0.distcp:", "(truncated or overwritten)",
                     "step-00000004: trainer-tensors.pt: missing",
                     "step-00000006: engine/__0_0.distcp: content differs", "--fresh",
                     "another --out", f"gem checkpoints verify {run}"):
        assert expected in message, message
    assert [s for s, _ in complete_checkpoints(run)] == [2, 4, 6]  # nothing deleted
    # Reading a run (load_run, export-user-embeddings) verifies too.
    with pytest.raises(GemCheckpointError, match="step-00000006 is damaged: engine/__0_0.distcp"):
        read_checkpoint(_step(run, 6))


def test_checkpoints_verify_command(run):
    runner = CliRunner()
    intact = runner.invoke(cli, ["checkpoints", "verify", str(run), "--json"])
    assert intact.exit_code == 0, intact.output
    report = json.loads(intact.output)
    assert report["ok"] and report["newest_verified"] == 6
    assert [c["status"] for c in report["checkpoints"]] == ["ok", "ok", "ok"]

    (_step(run, 2) / "trainer-tensors.pt").write_bytes(b"")
    (_step(run, 4) / "digests.json").unlink()
    flip_middle(_step(run, 6) / "trainer.json", count=8)
    (_step(run, 6) / "notes.txt").write_text("added later")
    damaged = runner.invoke(cli, ["checkpoints", "verify", str(run), "--json"])
    assert damaged.exit_code == 1, damaged.output
    report = json.loads(damaged.output)
    by_step = {c["step"]: c for c in report["checkpoints"]}
    assert by_step[2]["problems"][0].startswith("trainer-tensors.pt: 0 bytes, written as ")
    assert by_step[4]["problems"] == ["digests.json: missing, so no file can be verified"]
    assert by_step[6]["problems"] == ["trainer.json: content differs from its sha256 digest"]
    assert by_step[6]["unrecorded_files"] == ["notes.txt"]
    assert report["newest_verified"] is None and not report["ok"]
    text = runner.invoke(cli, ["checkpoints", "verify", str(run)])
    assert text.exit_code == 1
    assert "step-00000006  damaged" in text.output and "no checkpoint verifies" in text.output
