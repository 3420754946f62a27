"""Running a launcher (torchrun, ``gem train --nproc-per-node``) from a test with a time limit
that cannot leave ranks behind."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Mapping, Sequence


def run_process_group(command: Sequence[str], *, timeout: float,
                      env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``command`` in a session of its own and return its result; past ``timeout`` seconds
    stop the whole session: SIGTERM first (torchrun's agent then stops its ranks, which hold
    the pipes), SIGKILL 30 s later. The whole session, not only the launcher: a command need not be
    ``gem train`` (whose launcher takes its agent and ranks down with it), and any process
    left holding the pipes would keep the test (and CI) waiting."""
    process = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True,
                               env=None if env is None else dict(env))
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            stdout, stderr = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
    return subprocess.CompletedProcess(list(command), process.returncode, stdout, stderr)
