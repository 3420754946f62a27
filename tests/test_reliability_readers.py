"""The readers of a run directory turn damaged or foreign files into warnings or one-line errors
naming the file, never tracebacks: ``gem report`` and ``gem runs compare`` skip a damaged line of
``metrics.jsonl``/``eval.jsonl`` (not UTF-8, torn, not a record) with a warning, through the
trainer's own reader (:func:`gem_core.train.run_dir.read_records`; the trainer, which rewrites
the logs on resume, drops only a torn last line and refuses a damaged earlier one); a damaged
``summary.json`` is a one-line error; an unreadable checkpoint only loses the data comparison.
``gem checkpoints verify`` names a digest file nested too deeply to parse and a file that
cannot be read."""

from __future__ import annotations

import errno
import json
import logging
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from gem_core.cli.main import cli
from gem_core.errors import GemRunError

NOT_UTF8 = b'{"step": 5, "click": {"ne": "\xff\xfe"}}'


def _copy(small_run: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    return run


def _gem(*args: object):
    """``gem ARGS`` in this process, through the CLI group that turns GemErrors into one-line
    messages; an uncaught exception (a traceback for a user) fails the test."""
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"gem {' '.join(map(str, args))} raised {result.exception!r}:\n{result.output}")
    return result


def _damage_logs(run: Path) -> None:
    """A non-UTF-8 line and a foreign record before the last evaluation, and a torn last line
    of each log; a torn line inside metrics.jsonl."""
    evals = (run / "eval.jsonl").read_bytes()
    (run / "eval.jsonl").write_bytes(NOT_UTF8 + b"\n[1, 2]\n" + evals + b'{"step": 7, "cli')
    lines = (run / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    lines.insert(2, b'{"step": 3, "lo\n')
    (run / "metrics.jsonl").write_bytes(b"".join(lines) + b'{"step": 7')


def test_report_and_compare_skip_damaged_log_lines_with_a_warning(small_run, tmp_path):
    run = _copy(small_run, tmp_path)
    _damage_logs(run)
    report = _gem("report", run, "--out", tmp_path / "report")
    compare = _gem("runs", "compare", small_run, run, "--json")
    assert report.exit_code == 0, report.output
    assert (tmp_path / "report" / "index.html").is_file()
    assert compare.exit_code == 0, compare.output
    table = json.loads(compare.stdout)["runs"]
    assert table["run"] == table[small_run.name]  # the same figures: nothing else was lost
    for result in (report, compare):  # what the user sees: the log on stderr
        warnings = result.stderr.splitlines()
        for expected in (f"{run / 'eval.jsonl'} line 1: skipped", "not UTF-8",
                         f"{run / 'eval.jsonl'} line 2: skipped",
                         f"{run / 'eval.jsonl'}: dropped its last line",
                         f"{run / 'metrics.jsonl'} line 3: skipped",
                         f"{run / 'metrics.jsonl'}: dropped its last line"):
            assert any("WARNING" in w and expected in w for w in warnings), (expected, warnings)

    from gem_core.report.runs import read_run

    read = read_run(run)
    assert [r["step"] for r in read.metrics] == [1, 2, 3, 4, 5, 6]
    assert [e["step"] for e in read.evals] == [6]


def test_the_trainer_refuses_a_damaged_line_before_the_last_one(tmp_path, caplog):
    """The one reader, strict for the trainer: a damaged earlier line (here not UTF-8) stops a
    resume naming the file and line; a torn last line is dropped with a warning."""
    from gem_core.train.run_dir import read_records

    log = tmp_path / "eval.jsonl"
    log.write_bytes(b'{"step": 2}\n' + NOT_UTF8 + b'\n{"step": 6}\n')
    with pytest.raises(GemRunError, match=rf"{log} line 2 is not a JSON record .*not UTF-8"):
        read_records(log)
    assert [r["step"] for _, r in read_records(log, strict=False)] == [2, 6]
    log.write_bytes(b'{"step": 2}\n{"step": 6}\n' + NOT_UTF8)
    with caplog.at_level(logging.WARNING):
        assert [line for line, _ in read_records(log)] == ['{"step": 2}', '{"step": 6}']
    assert "dropped its last line, torn by an interrupted write" in caplog.text


@pytest.mark.parametrize("content", [
    pytest.param("truncated", id="truncated"),
    pytest.param(b'{"run": {"steps": 6}, "eval": {"click": {"ne": "\xff"}}}', id="not-utf-8"),
    pytest.param(b"[1, 2, 3]", id="a-json-list"),
    pytest.param(b'{"run": 6, "eval": {}}', id="not-a-summary"),
    pytest.param(b"[" * 100_000, id="nested-too-deeply"),
])
def test_a_damaged_summary_is_a_one_line_error_naming_it(small_run, tmp_path, content):
    run = _copy(small_run, tmp_path)
    summary = run / "summary.json"
    if content == "truncated":
        content = summary.read_bytes()[: summary.stat().st_size // 2]
    summary.write_bytes(content)
    for args in (["report", run, "--out", tmp_path / "report"],
                 ["runs", "compare", small_run, run]):
        result = _gem(*args)
        assert result.exit_code == 1, result.output
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith(f"Error: {summary} ") and "summary" in line, line


def test_an_unreadable_checkpoint_only_loses_the_data_comparison(small_run, tmp_path):
    run = _copy(small_run, tmp_path)
    trainer = run / "checkpoints" / "step-00000006" / "trainer.json"
    trainer.write_bytes(trainer.read_bytes()[:100])
    report = _gem("report", run, "--out", tmp_path / "report")
    compare = _gem("runs", "compare", small_run, run)
    assert report.exit_code == 0 and compare.exit_code == 0, report.output + compare.output
    for result in (report, compare):
        assert f"the data of {run} is not compared" in result.stderr, result.stderr
        assert str(trainer) in result.stderr
    assert "cannot tell whether the data is the same" in compare.stderr


def test_checkpoints_verify_names_a_digest_file_nested_too_deeply(small_run, tmp_path):
    run = _copy(small_run, tmp_path)
    (run / "checkpoints" / "step-00000006" / "digests.json").write_text("[" * 100_000)
    result = _gem("checkpoints", "verify", run)
    assert result.exit_code == 1, result.output
    assert "step-00000006  damaged" in result.output
    assert "digests.json: unreadable" in result.output
    assert "a resume would load step 3" in result.output


def test_checkpoints_verify_names_a_file_that_cannot_be_read(small_run, tmp_path, monkeypatch):
    import gem_core.checkpoint.digests as digests

    run = _copy(small_run, tmp_path)
    original = digests.digest_file

    def failing(path: Path) -> str:
        if path.name == "trainer.json" and path.parent.name == "step-00000006":
            raise OSError(errno.EIO, "Input/output error", str(path))
        return original(path)

    monkeypatch.setattr(digests, "digest_file", failing)
    result = _gem("checkpoints", "verify", run, "--json")
    assert result.exit_code == 1, result.output
    by_step = {c["step"]: c for c in json.loads(result.stdout)["checkpoints"]}
    assert by_step[6]["status"] == "damaged"
    assert by_step[6]["problems"] == ["trainer.json: unreadable (Input/output error)"]
    assert by_step[3]["status"] == "ok"
