"""Nothing from a run directory is unpickled: a pickle payload (an object whose ``__reduce__``
runs a shell command that creates a marker file) planted in every file the trainer and the
run-reading commands load never runs, and the error names the file. The digests are recomputed
after planting, as an attacker would, so what stops the payload is the loader, not the digest."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner

from gem_core.checkpoint.checkpointer import read_checkpoint
from gem_core.checkpoint.digests import write_digests
from gem_core.checkpoint.io import read_dcp
from gem_core.cli.main import cli
from gem_core.config import load_config
from gem_core.errors import GemCheckpointError
from gem_core.plugins import build_plugins
from gem_core.train.trainer import train
from gem_core.trained_run import load_run

SMALL = ["train.steps=2", "train.batch_size=16", "data.eval_rows=128",
         "train.eval_batch_size=128", "train.warmup_steps=1", "train.eval_every=0",
         "train.checkpoint_every=2", "data.max_seq_len=16", "model.interaction_dims=[16]",
         # what export-user-embeddings needs: a live upstream read through its PMA tokens
         "model.downstream_history=events", "model.pma_queries=2"]
STEP = "step-00000002"


class Payload:
    """Unpickling this runs ``touch MARKER``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _train(run: Path):
    return train(load_config(overrides=SMALL), build_plugins(), run, progress=False)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("pickles") / "base"
    _train(run)
    return run


def _plant_trainer_tensors(checkpoint: Path, payload: Payload) -> str:
    torch.save({"t0": payload}, checkpoint / "trainer-tensors.pt")
    return "trainer-tensors.pt refers to posix.system"


def _plant_legacy_trainer_file(checkpoint: Path, payload: Payload) -> str:
    for name in ("trainer.json", "trainer-tensors.pt"):
        (checkpoint / name).unlink()
    torch.save({"step": payload}, checkpoint / "trainer.pt")
    return "holds trainer.pt, the trainer state of an older version: a pickle"


def _plant_dcp_metadata(checkpoint: Path, payload: Payload) -> str:
    (checkpoint / "engine" / ".metadata").write_bytes(pickle.dumps(payload))
    return "engine/.metadata refers to posix.system, which DCP metadata never holds"


def _plant_distcp_value(checkpoint: Path, payload: Payload) -> str:
    # A well-formed DCP directory whose non-tensor value (a learning rate, stored as torch.save
    # bytes inside the .distcp file) is the payload.
    state = read_dcp(checkpoint / "engine")
    state["optimizer"]["param_groups"][0]["lr"] = payload
    shutil.rmtree(checkpoint / "engine")
    dcp.save(state, checkpoint_id=checkpoint / "engine", no_dist=True)
    return "the value of 'optimizer.param_groups.0.lr' in the DCP files"


PLANTS = {"trainer-tensors": _plant_trainer_tensors,
          "legacy-trainer.pt": _plant_legacy_trainer_file,
          "dcp-metadata": _plant_dcp_metadata, "distcp-value": _plant_distcp_value}


def _planted(base: Path, tmp_path: Path, plant) -> tuple[Path, Path, str]:
    run, marker = tmp_path / "run", tmp_path / "payload-ran"
    shutil.copytree(base, run)
    checkpoint = run / "checkpoints" / STEP
    expected = plant(checkpoint, Payload(marker))
    write_digests(checkpoint)
    return run, marker, expected


@pytest.mark.parametrize("kind", sorted(PLANTS))
def test_payload_never_runs_when_the_trainer_or_load_run_reads_it(base, tmp_path, kind):
    run, marker, expected = _planted(base, tmp_path, PLANTS[kind])
    with pytest.raises(GemCheckpointError) as resumed:
        _train(run)
    assert expected in str(resumed.value)
    assert "--fresh" in str(resumed.value) or "Do not trust" in str(resumed.value)
    with pytest.raises(GemCheckpointError) as loaded:
        load_run(run)  # export-user-embeddings, export-model, score, distill's teacher
    assert expected in str(loaded.value)
    assert not marker.exists()


def test_export_user_embeddings_refuses_a_planted_run(base, tmp_path):
    run, marker, expected = _planted(base, tmp_path, _plant_dcp_metadata)
    result = CliRunner().invoke(cli, ["export-user-embeddings", str(run), "--out",
                                      str(tmp_path / "export")])
    assert result.exit_code == 1 and expected in result.output, result.output
    assert "Traceback" not in result.output and not marker.exists()


def _full_state_checkpoint(base: Path, tmp_path: Path) -> Path:
    """The step-2 checkpoint rewritten as a full-state engine's (DeepSpeed): ``engine.pt`` with
    the weights and, beside it, a ``sharded/`` DCP directory."""
    checkpoint = tmp_path / "run" / "checkpoints" / STEP
    shutil.copytree(base, tmp_path / "run")
    trainer = json.loads((checkpoint / "trainer.json").read_text())
    trainer["format"] = "full"
    (checkpoint / "trainer.json").write_text(json.dumps(trainer))
    weights = read_dcp(checkpoint / "engine")["model"]
    torch.save({"model": weights, "optimizer": {}}, checkpoint / "engine.pt")
    (checkpoint / "engine").rename(checkpoint / "sharded")
    write_digests(checkpoint)
    return checkpoint


def test_full_state_engine_files_never_run_a_payload(base, tmp_path):
    checkpoint = _full_state_checkpoint(base, tmp_path)
    marker = tmp_path / "payload-ran"
    assert set(read_checkpoint(checkpoint)["engine"]) == {"model", "optimizer", "sharded"}

    (checkpoint / "sharded" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    write_digests(checkpoint)
    with pytest.raises(GemCheckpointError, match="sharded/.metadata refers to posix.system"):
        read_checkpoint(checkpoint)

    torch.save({"model": {}, "optimizer": Payload(marker)}, checkpoint / "engine.pt")
    write_digests(checkpoint)
    with pytest.raises(GemCheckpointError, match="engine.pt refers to posix.system, which a "
                                                 "checkpoint never holds; it was not loaded"):
        read_checkpoint(checkpoint)
    assert not marker.exists()


def test_the_payload_runs_when_unpickled(tmp_path):
    """The control: the planted object does run its command under a plain unpickler."""
    marker = tmp_path / "payload-ran"
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.exists()
