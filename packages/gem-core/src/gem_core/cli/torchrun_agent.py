"""torchrun's agent as ``gem train`` starts it: ``python -m gem_core.cli.torchrun_agent ARGS``
runs ``python -m torch.distributed.run ARGS``, except that a stop by a signal (which the agent
forwards to its ranks, then waits for them) ends with the signal's status (143, 130) instead of
the agent's traceback: the launcher prints what the ranks saved."""

from __future__ import annotations

import runpy
import sys

from gem_core.process_life import exit_status
from gem_core.stack_dump import enable_stack_dumps


def main() -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    enable_stack_dumps()  # as every gem process: kill -USR1 PID prints its threads' stacks
    try:
        runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
    except SignalException as stopped:
        sys.stderr.flush()
        sys.exit(exit_status(stopped.sigval))


if __name__ == "__main__":
    main()
