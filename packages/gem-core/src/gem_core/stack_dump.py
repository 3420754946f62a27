"""Every thread's Python stack on demand: ``kill -USR1 PID`` makes a ``gem`` process (the
launcher, torchrun's agent as ``gem train`` starts it, each rank) print the stacks of all its
threads to stderr and go on running. A run that hangs (a rank inside a collective, an agent
waiting on a rank) says where without a debugger; the test harness asks for the dumps of every
process of a command before it stops one that ran past its time limit
(:func:`gem_core.testing.processes.run_process_group`). Standard library only: torchrun's agent
imports it without the trainer."""

from __future__ import annotations

import faulthandler
import signal
import sys

STACK_DUMP_SIGNAL = getattr(signal, "SIGUSR1", None)
"""The signal that asks for the dump (POSIX only: Windows has no SIGUSR1, and no dump)."""


def enable_stack_dumps() -> bool:
    """Print every thread's stack to stderr on :data:`STACK_DUMP_SIGNAL`, instead of its default
    action (the end of the process). False where the platform has no such signal."""
    if STACK_DUMP_SIGNAL is None:
        return False
    faulthandler.register(STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True)
    return True
