"""The process group's teardown at the end of a run is bounded: a ``destroy_process_group`` that
hangs (pytorch/pytorch#75097) no longer keeps a finished rank alive without end."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from gem_core.distributed import destroy_within


def test_a_teardown_that_returns_is_waited_for():
    done = []
    assert destroy_within(lambda: done.append(1), limit_s=5.0) is True
    assert done == [1]


def test_a_teardown_that_hangs_is_left_behind_with_a_warning_and_the_stacks(caplog, capfd):
    release = threading.Event()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="gem_core.distributed"):
        assert destroy_within(lambda: release.wait(30), limit_s=0.5) is False
    took = time.monotonic() - started
    release.set()
    assert 0.5 <= took < 10
    assert "did not finish within 0.5 s" in caplog.text
    stderr = capfd.readouterr().err
    # every thread's stack: the caller's (this test) and the stuck teardown's, inside its wait
    assert "test_destroy_within.py" in stderr and " in wait" in stderr, stderr


def test_a_teardown_that_fails_raises_its_error_in_the_caller():
    def fails() -> None:
        raise RuntimeError("gloo: connection closed by peer")

    with pytest.raises(RuntimeError, match="connection closed by peer"):
        destroy_within(fails, limit_s=5.0)
