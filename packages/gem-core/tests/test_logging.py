"""What a run logs (issue #21, item 3): a plain line every ``train.log_every_s`` seconds when
no terminal is attached, the start-up block once, ranks other than 0 only warnings (prefixed),
and ``--log-level`` after the sub-command."""

from __future__ import annotations

import logging
import re
import warnings

import pytest
from click.testing import CliRunner

from gem_core.cli.main import cli
from gem_core.logs import configure_logging, current_logging, rank_threshold, text_format
from gem_core.train.progress import Progress, format_duration


@pytest.fixture
def restore_logging():
    """configure_logging replaces the root handlers: put pytest's (caplog's) back after. It
    also routes Python warnings to logging: undone before (an earlier CLI test left it on
    while pytest put its own warning display back, which would make it a no-op) and after."""
    root = logging.getLogger()
    handlers, level, settings = root.handlers[:], root.level, current_logging()
    logging.captureWarnings(False)
    yield
    configure_logging(*settings)
    logging.captureWarnings(False)
    root.handlers[:] = handlers
    root.setLevel(level)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _record(step: int, loss: float, step_time: float, samples: float, mfu: float) -> dict:
    return {"step": step, "loss": loss, "step_time_s": step_time,
            "samples_per_s": samples / step_time, "tokens_per_s": 0.0, "mfu": mfu}


def test_without_a_terminal_a_line_every_log_every_s_with_window_means_and_eta(caplog):
    clock = _Clock()
    progress = Progress(total=10, initial=0, enabled=True, bar=True, log_every_s=10.0,
                        terminal=False, clock=clock)
    losses, step_times, mfus = [0.9, 0.7, 0.5, 0.4, 0.3], [2, 2, 1, 3, 1], [.02, .02, .05, .03, .05]
    with caplog.at_level(logging.INFO, logger="gem_core.train.progress"):
        for step, (loss, step_time, mfu) in enumerate(zip(losses, step_times, mfus), start=1):
            clock.now += 5.0  # 5 s of wall time a step: lines after steps 2 and 4
            progress.update(_record(step, loss, float(step_time), samples=100.0, mfu=mfu))
    lines = [r.getMessage() for r in caplog.records if r.name == "gem_core.train.progress"]
    assert len(lines) == 2, lines
    # Steps 1-2: mean loss 0.8, 200 samples in 4 s of step time, MFU 2 %; 10 s of wall time
    # for 2 steps, 8 to go: 40 s.
    assert lines[0] == "step 2/10, loss 0.8000, 50 samples/s, MFU 2%, ETA 40s"
    # Steps 3-4 only (a new window): MFU weighted by step time (0.05 * 1 + 0.03 * 3) / 4, not
    # the mean of the steps' 4 %; 20 s for 4 steps, 6 to go.
    assert lines[1] == "step 4/10, loss 0.4500, 50 samples/s, MFU 3.5%, ETA 30s"


def test_no_lines_on_a_terminal_with_the_bar_off_rank_zero_or_with_zero_seconds(caplog):
    clock = _Clock()
    quiet = [Progress(total=4, initial=0, enabled=False, log_every_s=1.0, terminal=False,
                      clock=clock),
             Progress(total=4, initial=0, enabled=True, log_every_s=0.0, terminal=False,
                      clock=clock)]
    with caplog.at_level(logging.INFO, logger="gem_core.train.progress"):
        for step in (1, 2):
            clock.now += 5.0
            for progress in quiet:
                progress.update(_record(step, 0.5, 1.0, 10.0, 0.01))
    assert caplog.records == []
    # --no-progress on a terminal: no bar, so the lines take its place.
    lines_instead = Progress(total=4, initial=0, enabled=True, bar=False, log_every_s=1.0,
                             terminal=True, clock=clock)
    assert lines_instead.bar is None and lines_instead.log_every_s == 1.0


def test_durations_read_as_hours_minutes_seconds():
    assert [format_duration(s) for s in (0, 59.6, 75, 3700)] == ["0s", "1m00s", "1m15s",
                                                                 "1h01m"]


def test_ranks_other_than_zero_print_only_warnings_prefixed(restore_logging, capsys):
    assert rank_threshold("INFO", 0) == logging.INFO
    assert rank_threshold("INFO", 3) == logging.WARNING
    assert rank_threshold("ERROR", 3) == logging.ERROR
    assert rank_threshold("DEBUG", 3) == logging.DEBUG  # debugging wants every rank
    assert "[rank" not in text_format(0) and "[rank 2] " in text_format(2)
    configure_logging("INFO", "text", rank=1)
    logger = logging.getLogger("gem_core.test_rank")
    logger.info("start-up block")
    logger.warning("a rank's own problem")
    warnings.warn_explicit("a library's deprecation", FutureWarning, "lib.py", 7)
    err = capsys.readouterr().err
    assert "start-up block" not in err
    assert re.search(r"WARNING \[rank 1\] gem_core.test_rank: a rank's own problem", err)
    assert re.search(r"WARNING \[rank 1\] py.warnings: lib.py:7: FutureWarning: a library", err)


def test_log_level_after_the_sub_command_and_the_dropped_data_options_note(restore_logging):
    args = ["config", "show", "--no-sizes", "--set", "data.source=synthetic-ads"]
    noted = CliRunner().invoke(cli, args)
    assert noted.exit_code == 0, noted.output
    assert ("data.source synthetic-ads replaces synthetic of tiny: its [data.options] "
            "(num_items = 2000, num_users = 5000) are dropped") in noted.output
    quiet = CliRunner().invoke(cli, [*args, "--log-level", "WARNING"])
    assert quiet.exit_code == 0, quiet.output
    assert "are dropped" not in quiet.output and "[data]" in quiet.output


def test_a_train_without_a_terminal_logs_step_lines_and_the_start_up_once(restore_logging,
                                                                          tmp_path):
    """CliRunner's streams are not terminals: the lines replace the bar."""
    result = CliRunner().invoke(cli, [
        "train", "--log-level", "INFO", "--out", str(tmp_path / "run"),
        "--set", "train.steps=3", "--set", "train.log_every_s=0.000001",
        "--set", "train.batch_size=16", "--set", "data.eval_rows=64",
        "--set", "train.eval_batch_size=64", "--set", "data.max_seq_len=16",
        "--set", "model.num_layers=1", "--set", "model.interaction_dims=[16]",
        "--set", "train.checkpoint_every=0"])
    assert result.exit_code == 0, result.output
    steps = re.findall(r"progress: step (\d)/3, loss \d\.\d{4}, [\d,]+ samples/s, MFU ",
                       result.output)
    assert steps == ["1", "2", "3"], result.output
    assert result.output.count("training tiny: steps 1-3 of 3") == 1
    assert re.search(r"\n  attention +\S+ \(gem-\w+\): ", result.output)
    assert "auto chose" not in result.output and '"embedding_dim"' not in result.output


def test_the_launcher_passes_the_log_options_given_after_the_sub_command_to_every_rank(
        restore_logging, tmp_path, monkeypatch):
    import gem_core.cli.launch as launch_cli

    launched = []

    class Agent:  # torchrun's agent as the launcher starts it, done at once
        def __init__(self, args, **options):
            launched.append(args)
            self.pid, self.returncode = 0, 0

        def __enter__(self):
            return self

        def __exit__(self, *exc_info):
            return None

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(launch_cli.subprocess, "Popen", Agent)
    result = CliRunner().invoke(cli, ["train", "--nproc-per-node", "2", "--out",
                                      str(tmp_path / "run"), "--log-level", "WARNING",
                                      "--log-format", "json"])
    assert result.exit_code == 0, result.output
    args = launched[0]
    assert args[args.index("gem_core.cli.main") + 1:args.index("train")] == [
        "--log-level", "WARNING", "--log-format", "json"]
