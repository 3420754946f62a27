"""TensorBoard and tqdm are optional dependencies (``gem-core[tensorboard]``,
``gem-core[progress]``): ``train.tensorboard`` (auto / on / off) says what a run does without
TensorBoard, and without tqdm a terminal gets the plain progress lines, said once. A missing
package is simulated by a ``None`` entry in ``sys.modules``, which makes its import fail."""

from __future__ import annotations

import logging
import sys

import pytest

from gem_core.config import load_config
from gem_core.errors import GemConfigError
from gem_core.plugins import build_plugins
from gem_core.train.progress import Progress
from gem_core.train.run_dir import TENSORBOARD_DIR, RunDirectory
from gem_core.train.trainer import train

RECORD = {"step": 1, "loss": 0.75, "samples": 16, "tokens": 100, "step_time_s": 0.5}


@pytest.fixture
def no_tensorboard(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)


@pytest.fixture
def no_tqdm(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)


def _write_a_step(run: RunDirectory) -> None:
    run.open_tensorboard(first_step=0)
    run.append_metrics(RECORD)
    run.close()


def _messages(caplog, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger]


def test_auto_writes_events_when_tensorboard_imports(tmp_path):
    _write_a_step(RunDirectory(tmp_path, enabled=True, tensorboard="auto"))
    events = list((tmp_path / TENSORBOARD_DIR).glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


def test_auto_without_tensorboard_says_so_once_and_writes_the_logs(tmp_path, no_tensorboard,
                                                                    caplog):
    with caplog.at_level(logging.INFO, logger="gem_core.train.run_dir"):
        _write_a_step(RunDirectory(tmp_path, enabled=True, tensorboard="auto"))
        RunDirectory(tmp_path / "other-rank", enabled=False, tensorboard="auto")
    lines = _messages(caplog, "gem_core.train.run_dir")
    assert len(lines) == 1, lines
    assert "TensorBoard events are not written" in lines[0]
    assert "torch.utils.tensorboard" in lines[0] and "gem-core[tensorboard]" in lines[0]
    assert not (tmp_path / TENSORBOARD_DIR).exists()
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


def test_on_without_tensorboard_stops_every_rank_at_start_up(tmp_path, no_tensorboard):
    for enabled in (True, False):  # rank 0 and the others alike
        with pytest.raises(GemConfigError, match=r"train.tensorboard is 'on' but torch.utils."
                                                 r"tensorboard does not import .*gem-core\["
                                                 r"tensorboard\]"):
            RunDirectory(tmp_path, enabled=enabled, tensorboard="on")
    # The trainer passes the key: the run stops before building anything.
    config = load_config(overrides=["train.tensorboard=on", "train.steps=1"])
    with pytest.raises(GemConfigError, match="train.tensorboard is 'on'"):
        train(config, build_plugins(load_entry_points=False), tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_off_writes_no_events_and_never_imports_tensorboard(tmp_path, no_tensorboard, caplog):
    with caplog.at_level(logging.INFO, logger="gem_core.train.run_dir"):
        _write_a_step(RunDirectory(tmp_path, enabled=True, tensorboard="off"))
    assert _messages(caplog, "gem_core.train.run_dir") == []
    assert not (tmp_path / TENSORBOARD_DIR).exists()


def test_a_mode_other_than_auto_on_off_is_refused_naming_the_key():
    with pytest.raises(GemConfigError, match=r"train.tensorboard.*auto.*on.*off.*yes"):
        load_config(overrides=["train.tensorboard=yes"])


def test_without_tqdm_a_terminal_gets_the_plain_lines_said_once(no_tqdm, caplog):
    with caplog.at_level(logging.INFO, logger="gem_core.train.progress"):
        progress = Progress(total=4, initial=0, enabled=True, bar=True, log_every_s=7.0,
                            terminal=True)
    assert progress.bar is None and progress.log_every_s == 7.0
    lines = _messages(caplog, "gem_core.train.progress")
    assert len(lines) == 1 and "no progress bar: tqdm does not import" in lines[0], lines
    # Off a terminal no bar is wanted, so nothing is said about tqdm.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="gem_core.train.progress"):
        Progress(total=4, initial=0, enabled=True, bar=True, log_every_s=7.0, terminal=False)
    assert _messages(caplog, "gem_core.train.progress") == []


def test_with_tqdm_a_terminal_gets_the_bar():
    progress = Progress(total=4, initial=0, enabled=True, bar=True, log_every_s=7.0,
                        terminal=True)
    try:
        assert progress.bar is not None and progress.log_every_s == 0.0
    finally:
        progress.close()
