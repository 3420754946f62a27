"""How the processes of a run end together (standard library only: the launcher and torchrun's
agent import it without the trainer).

The signals that stop a run and the status a stopped process ends with, and, on Linux, a
process tied to its parent's life (``PR_SET_PDEATHSIG``): ``gem train``'s launcher gives
torchrun's agent SIGKILL for its death (:func:`agent_preexec`), each rank gives itself SIGTERM
for its agent's (:func:`rank_dies_with_agent`; see :mod:`gem_core.train.stop_signal`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""The signals that stop a run cleanly (a scheduler's preemption or ``kill``; Ctrl-C)."""

REPEAT_AFTER_S = 1.0
"""A stop signal sooner than this after the first is the same stop: a scheduler that signals
every process of a job at once (SLURM's ``scancel``) reaches a rank both directly and through
torchrun's agent, which forwards what it gets. A later one is a second signal: stop at once."""

LAUNCHER_PID = "GEM_LAUNCHER_PID"
"""Environment variable ``gem train``'s launcher gives torchrun's agent (and so its ranks)."""

_PR_SET_PDEATHSIG = 1


def exit_status(signum: int) -> int:
    """The shell's status of a process ended by ``signum``: 143 for SIGTERM, 130 for SIGINT."""
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def die_with_parent(signum: int) -> bool:
    """Linux: have the kernel send ``signum`` to this process when its parent dies
    (``PR_SET_PDEATHSIG``); False where that is not available. One system call: safe between
    fork and exec (``preexec_fn``)."""
    return _LIBC is not None and _LIBC.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0


def agent_preexec(launcher: int) -> Callable[[], None]:
    """``preexec_fn`` of torchrun's agent: SIGKILL when the launcher (pid ``launcher``) dies,
    and an exit at once when it already has."""
    def preexec() -> None:
        die_with_parent(signal.SIGKILL)
        if os.getppid() != launcher:
            os._exit(1)
    return preexec


def rank_dies_with_agent() -> None:
    """A rank started by torchrun's agent (``TORCHELASTIC_RUN_ID``): SIGTERM when the agent
    dies, a clean stop bounded by ``train.stop_grace_s``. When ``gem train``'s launcher started
    the agent and the agent died before this call (its parent is no longer the launcher), the
    rank ends at once."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not die_with_parent(signal.SIGTERM):
        return
    launcher = os.environ.get(LAUNCHER_PID)
    if launcher and parent_of(os.getppid()) != int(launcher):
        os.kill(os.getpid(), signal.SIGTERM)


def parent_of(pid: int) -> int | None:
    """The parent of process ``pid`` (Linux ``/proc``); None when it is gone."""
    stat = process_stat(pid)
    return None if stat is None else stat[0]


def process_stat(pid: int) -> tuple[int, str, str] | None:
    """``(parent, state, start time)`` of ``pid`` (Linux ``/proc``), or None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0], fields[19]  # after "pid (comm)": state, ppid, ... start


def _load_libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _load_libc()
