"""Running a command from a test with a time limit that cannot leave processes behind, and that
says where a hung command was: past the limit, every ``gem`` process of the command (the
launcher, torchrun's agent, the ranks, wherever their sessions) prints its threads' stacks
(:mod:`gem_core.stack_dump`) before the command is stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Mapping, Sequence

from gem_core.process_life import process_stat
from gem_core.stack_dump import STACK_DUMP_SIGNAL

_GEM_PROGRAMS = {b"gem_core.cli.main", b"gem_core.cli.torchrun_agent", b"gem"}
"""How a ``gem`` process shows in its command line (``python -m ...`` or the ``gem`` script)."""

DUMP_WAIT_S = 3.0
"""How long the processes get to print their stacks before they are stopped."""


class CommandTimedOut(AssertionError):
    """A command ran past its time limit (raised by ``run_process_group(raise_on_timeout=True)``);
    the message ends with its stderr's tail, the processes' stack dumps in it."""


def run_process_group(command: Sequence[str], *, timeout: float,
                      env: Mapping[str, str] | None = None, cwd: Path | None = None,
                      raise_on_timeout: bool = False) -> subprocess.CompletedProcess:
    """Run ``command`` in a session of its own and return its result. Past ``timeout`` seconds:
    the stacks of its ``gem`` processes are dumped (into its stderr), then the whole session is
    stopped: SIGTERM first (torchrun's agent then stops its ranks, which hold the pipes),
    SIGKILL 30 s later, and any descendant still alive (torchrun's agent runs in a session of its
    own) SIGKILL too. The whole tree, not only the launcher: any process left holding the pipes
    would keep the test (and CI) waiting. ``raise_on_timeout``: raise :class:`CommandTimedOut`
    instead of returning the stopped command's result."""
    process = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True, cwd=cwd,
                               env=None if env is None else dict(env))
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        return subprocess.CompletedProcess(list(command), process.returncode, stdout, stderr)
    except subprocess.TimeoutExpired:
        pass
    tree = descendants(process.pid)
    dumped = request_stack_dumps([process.pid, *alive(tree)])
    if dumped:
        time.sleep(DUMP_WAIT_S)
    _signal_group(process.pid, signal.SIGTERM)
    try:
        stdout, stderr = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        _signal_group(process.pid, signal.SIGKILL)
        for pid in alive(tree):
            _signal(pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
    stderr = (stderr or "") + (
        f"\n[test harness] {' '.join(command)!r} (pid {process.pid}) ran past its "
        f"{timeout:.0f} s limit and was stopped; stacks dumped above by the gem processes "
        f"{dumped or 'none'} of its tree {[process.pid, *tree]}\n")
    if raise_on_timeout:
        raise CommandTimedOut(f"timed out after {timeout:.0f} s (status {process.returncode}); "
                              f"stdout tail:\n{(stdout or '')[-2000:]}\nstderr tail:\n"
                              f"{stderr[-30000:]}")
    return subprocess.CompletedProcess(list(command), process.returncode, stdout, stderr)


def descendants(root: int) -> dict[int, str]:
    """Every process below ``root``, parents first: ``{pid: start time}`` (the start time tells
    a pid reused since from the process found). Empty where there is no ``/proc``."""
    stats = {}
    for entry in Path("/proc").glob("[0-9]*"):
        if (stat := process_stat(int(entry.name))) is not None:
            stats[int(entry.name)] = stat
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in stats.items():
        children.setdefault(parent, []).append(pid)
    found: dict[int, str] = {}
    queue = [root]
    while queue:
        for child in children.get(queue.pop(0), ()):
            if child not in found:
                found[child] = stats[child][2]
                queue.append(child)
    return found


def alive(processes: dict[int, str]) -> list[int]:
    """Those of ``processes`` (``{pid: start time}``) still running: not gone, not a reused pid,
    not a zombie waiting for its parent to reap it."""
    return [pid for pid, started in processes.items()
            if (stat := process_stat(pid)) is not None and stat[2] == started and stat[1] != "Z"]


def request_stack_dumps(pids: Sequence[int]) -> list[int]:
    """Send :data:`~gem_core.stack_dump.STACK_DUMP_SIGNAL` to each of ``pids`` that is a ``gem``
    process (only those handle it: to any other it is the end); the pids signalled."""
    if STACK_DUMP_SIGNAL is None:
        return []
    signalled = []
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if _GEM_PROGRAMS & {os.path.basename(arg) for arg in argv}:
            if _signal(pid, STACK_DUMP_SIGNAL):
                signalled.append(pid)
    return signalled


def _signal(pid: int, signum: int) -> bool:
    try:
        os.kill(pid, signum)
        return True
    except ProcessLookupError:
        return False


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass
