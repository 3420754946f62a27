"""Clean stops: SIGTERM (a scheduler's preemption, ``kill``) or SIGINT (Ctrl-C) to a run.

What a rank does (:class:`StopSignals`, held by :func:`gem_core.train.trainer.train` for the
whole run):

- The first signal only sets a flag; nothing else happens in the signal's context. The trainer
  reads the flag once per step, inside the reduction every step already makes (one more number
  in the same tensor, no collective of its own), so every rank of a group sees the same verdict
  after the same step and all of them stop at that step boundary: they save a checkpoint of it,
  log what they did and end with :class:`RunStopped` (status 143 for SIGTERM, 130 for SIGINT).
  A signal during the last step lets the run finish (its checkpoint and evaluation are due).
- A watcher thread bounds the stop: if the run has not ended ``train.stop_grace_s`` seconds
  after the first signal (a long step, a slow save, a rank that hangs), or when a second signal
  comes (at least :data:`REPEAT_AFTER_S` after the first), the process ends at once with the
  same status and a line saying so. The watcher hears signals through Python's wakeup file
  descriptor, written by the C-level handler, so it acts even while the main thread is blocked
  inside torch (a collective, a write), where a Python handler would not run.

A signal within :data:`~gem_core.process_life.REPEAT_AFTER_S` of the first counts as the same
one. How the launcher forwards signals to the ranks, and ties the agent's and the ranks' lives
to its own: :mod:`gem_core.cli.launch`, :mod:`gem_core.process_life`.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any, Callable

from gem_core.errors import GemRunError
from gem_core.process_life import REPEAT_AFTER_S, STOP_SIGNALS, exit_status, signal_name

log = logging.getLogger(__name__)


class RunStopped(GemRunError):
    """The run stopped on a signal at a step boundary; ``checkpoint`` is the checkpoint of
    ``step`` it saved (None: none could be)."""

    def __init__(self, *, signum: int | None, step: int, checkpoint: Path | None,
                 run_dir: Path) -> None:
        # None: another rank was signalled; the stop is the same.
        signum = signal.SIGTERM if signum is None else signum
        self.signum, self.step, self.checkpoint, self.run_dir = signum, step, checkpoint, run_dir
        self.exit_code = exit_status(signum)
        if checkpoint is not None:
            saved = f"saved the checkpoint of step {step} ({checkpoint})"
        else:
            saved = f"no checkpoint of step {step} could be saved"
        super().__init__(f"stopped by {signal_name(signum)} after step {step}: {saved}; run the "
                         f"same command again (gem train --out {run_dir} ...) to resume from it")


class StopSignals:
    """SIGTERM and SIGINT as a request to stop (see the module docstring), while entered.

    Outside the main thread (a trainer called from another thread) nothing is installed and
    :attr:`signum` stays None; a signal this process ignores (``nohup``, SIGINT of ``cmd &``)
    stays ignored. ``announce``: log the stop (rank 0); ``exit`` ends the process
    (``os._exit``; tests replace it)."""

    def __init__(self, grace_s: float, *, announce: bool = True,
                 exit: Callable[[int], Any] = os._exit) -> None:
        self.grace_s = float(grace_s)
        self.announce = announce
        self._exit = exit
        self.signum: int | None = None
        self.received_at: float | None = None
        self._previous: dict[int, Any] = {}
        self._previous_wakeup: int | None = None
        self._pipe: tuple[int, int] | None = None
        self._watcher: threading.Thread | None = None

    @property
    def requested(self) -> float:
        """1.0 once a stop was asked for, else 0.0 (summed across ranks by the trainer)."""
        return 0.0 if self.signum is None else 1.0

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        read, write = os.pipe()
        os.set_blocking(write, False)
        self._pipe = (read, write)
        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) is not signal.SIG_IGN:  # ignored (nohup, `cmd &`) stays
                self._previous[signum] = signal.signal(signum, _no_op)
        self._previous_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self._watcher = threading.Thread(target=self._watch, name="gem-stop-signals",
                                         daemon=True)
        self._watcher.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._pipe is None:
            return
        signal.set_wakeup_fd(self._previous_wakeup if self._previous_wakeup is not None else -1)
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        os.write(self._pipe[1], b"\0")  # after any signal's byte: the watcher ends there
        if self._watcher is not None:
            self._watcher.join()
        for fd in self._pipe:
            os.close(fd)
        self._pipe = None

    # -- the watcher thread ---------------------------------------------------------------------

    def _watch(self) -> None:
        assert self._pipe is not None
        read = self._pipe[0]
        while True:
            timeout = None
            if self.received_at is not None:
                timeout = max(0.0, self.received_at + self.grace_s - time.monotonic())
            ready, _, _ = select.select([read], [], [], timeout)
            if not ready:
                self._end(f"the run did not stop within train.stop_grace_s = {self.grace_s:g} s "
                          f"of {signal_name(self.signum or signal.SIGTERM)}")
                return
            for signum in os.read(read, 512):  # signal numbers in order; 0: the run ended
                if signum == 0 or (signum in STOP_SIGNALS and self._received(signum)):
                    return

    def _received(self, signum: int) -> bool:
        """Note a signal; True when the process was told to end."""
        now = time.monotonic()
        if self.received_at is None:
            self.signum, self.received_at = signum, now
            if self.grace_s <= 0:
                self._end(f"{signal_name(signum)} with train.stop_grace_s = 0")
                return True
            if self.announce:
                log.warning("%s received: the run stops at the end of this step and saves its "
                            "checkpoint (within train.stop_grace_s = %g s; a second signal stops "
                            "at once, without it)", signal_name(signum), self.grace_s)
        elif now - self.received_at >= REPEAT_AFTER_S:
            self._end(f"a second signal ({signal_name(signum)})")
            return True
        return False

    def _end(self, why: str) -> None:
        """Stop the process now (from the watcher thread: no lock the main thread may hold is
        taken; the line goes straight to stderr)."""
        if self.announce:
            line = (f"gem train: stopping at once ({why}); running the same command again "
                    "resumes from the newest complete checkpoint\n")
            try:
                os.write(sys.stderr.fileno(), line.encode())
            except (OSError, ValueError):
                pass
        self._exit(exit_status(self.signum or signal.SIGTERM))


def _no_op(signum: int, frame: FrameType | None) -> None:
    """The Python-level handler: the watcher thread does the work (see the module docstring);
    installing one keeps the default action (death, KeyboardInterrupt) away."""
