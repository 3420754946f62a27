"""How a rank of a multi-process run ends: its work done, its output flushed, then ``os._exit``.

``torch.distributed.destroy_process_group`` unregisters a gloo group but does not stop its C++
worker threads: they live on until the last reference to the group goes, and in a 2-rank run
they are still there when the interpreter starts finalizing (measured: two ``pt_gloo_runloop``
threads and a ``gloo_tcp_loop`` per group, after every TorchRec, DDP and DeepSpeed run). A
worker that releases its last work item (tensors owned by Python objects) while the interpreter
is being torn down cannot take the GIL any more; the thread is unwound from under a ``noexcept``
frame and the process aborts: "terminate called without an active exception", SIGABRT, after
the run has finished. It is a race, so it shows under load (CI) and not alone.

A rank therefore skips interpreter finalization: once the command has returned (the trainer
has joined its own threads, saved, and destroyed the process group; see
:mod:`gem_core.train.teardown`), logging and the standard streams are flushed and the process
exits with the command's status through ``os._exit``. Single-process runs, and code that calls
the trainer in-process, end normally.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import Callable


def is_process_group_rank() -> bool:
    """Whether this process is one rank of several started by a launcher (torchrun sets
    ``WORLD_SIZE``)."""
    return int(os.environ.get("WORLD_SIZE", "1") or "1") > 1


def exit_code(code: object) -> int:
    """``SystemExit.code`` as a process status: None is 0, an integer itself, anything else (a
    message, already printed) 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def run_then_exit(command: Callable[[], None]) -> None:
    """Run ``command`` (a click command in standalone mode, which ends with ``SystemExit``),
    then flush and ``os._exit`` with its status; an uncaught exception is printed and exits 1,
    as the interpreter would."""
    code = 1
    try:
        command()
        code = 0
    except SystemExit as stop:
        code = exit_code(stop.code)
    except BaseException:  # noqa: BLE001 - printed as the interpreter would, then exit 1
        traceback.print_exc()
        code = 1
    finally:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe or stream: nothing left to flush to
                pass
        os._exit(code)
