"""What a user watching a run sees, on rank 0 only.

On a terminal, the progress bar (tqdm, an optional dependency). Anywhere else (a file, a pipe,
a scheduler's log), where a bar would print nothing useful, or without tqdm, a plain log line
every ``train.log_every_s`` seconds of wall time: step and total, loss, samples/s, ETA and the
MFU against this device's measured peak. The start-up block (what runs, and each backend with
why it was chosen) is logged once.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

from gem_core.config import GemConfig, unstructure

log = logging.getLogger(__name__)


def log_start(config: GemConfig, backends: dict[str, dict[str, Any]], *, device: str,
              world_size: int, start_step: int, stop: int, run_dir: Path) -> None:
    """One start-up record: the run in a line, then one line per backend (kind, name, package,
    why). The whole configuration goes to DEBUG (it is in the run's config.toml anyway)."""
    ranks = f"{world_size} rank" + ("s" if world_size != 1 else "")
    width = max(map(len, backends))
    lines = [f"training {config.name}: steps {start_step + 1}-{stop} of {config.train.steps}, "
             f"{config.train.batch_size} samples a step, {device}, {ranks}; configuration in "
             f"{run_dir / 'config.toml'}; backends (kind, name, package, why):"]
    lines += [f"  {kind:<{width}}  {info['name']} ({info['package']}): {info['reason']}"
              for kind, info in backends.items()]
    log.info("\n".join(lines))
    log.debug("configuration: %s", json.dumps(unstructure(config)))


def format_duration(seconds: float) -> str:
    """``75`` -> ``1m15s``; ``3700`` -> ``1h01m``."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def _tqdm_or_none() -> Any:
    """tqdm's bar class, or ``None`` (logged once, with the reason) where tqdm, an optional
    dependency, does not import: the plain lines then take the bar's place."""
    try:
        from tqdm import tqdm
    except ImportError as error:
        log.info("no progress bar: tqdm does not import (%s); a plain line every "
                 "train.log_every_s seconds instead (pip install 'gem-core[progress]' for the "
                 "bar)", error)
        return None
    return tqdm


class Progress:
    """The bar on a terminal, else periodic log lines (``log_every_s``; 0: none); nothing on
    ranks other than 0 (``enabled`` false).

    ``bar`` false (``--no-progress``) leaves the bar out even on a terminal; the lines then take
    its place. ``terminal`` and ``clock`` are stderr's TTY state and ``time.monotonic`` unless
    given (tests).
    """

    def __init__(self, *, total: int, initial: int, enabled: bool, stop: int | None = None,
                 bar: bool = True, log_every_s: float = 0.0, terminal: bool | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.stop = total, stop if stop is not None else total
        self.step = initial
        self.bar = None
        self.log_every_s = 0.0
        self.clock = clock
        if not enabled:
            return
        on_terminal = sys.stderr.isatty() if terminal is None else terminal
        tqdm = _tqdm_or_none() if bar and on_terminal else None
        if tqdm is not None:
            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                            file=sys.stderr)
        else:
            self.log_every_s = log_every_s
        self.started = self.last_line = clock()
        self.first_step = initial
        self._reset_window()

    def _reset_window(self) -> None:
        self.window_steps = 0
        self.window_loss = 0.0
        self.window_samples = 0.0
        self.window_time = 0.0
        self.window_flops_share = 0.0  # sum of mfu * step time: the window's MFU numerator

    def update(self, record: dict[str, Any]) -> None:
        self.step = record["step"]
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.4f}",
                                 samples_s=f"{record['samples_per_s']:.0f}",
                                 tokens_s=f"{record['tokens_per_s']:.0f}", refresh=False)
            self.bar.update(1)
        if not self.log_every_s:
            return
        step_time = record["step_time_s"]
        self.window_steps += 1
        self.window_loss += record["loss"]
        self.window_samples += record["samples_per_s"] * step_time
        self.window_time += step_time
        mfu = record.get("mfu")  # absent where the device's peak is unknown
        if mfu is not None and math.isfinite(mfu):
            self.window_flops_share += mfu * step_time
        now = self.clock()
        if now - self.last_line >= self.log_every_s:
            log.info("%s", self.line(now))
            self.last_line = now
            self._reset_window()

    def line(self, now: float) -> str:
        """The window since the last line: its mean loss, samples/s over its step times and
        MFU; the ETA from the wall time per step of this run so far (evaluations and
        checkpoints included)."""
        parts = [f"step {self.step}/{self.total}",
                 f"loss {self.window_loss / max(self.window_steps, 1):.4f}"]
        if self.window_time > 0:
            parts.append(f"{self.window_samples / self.window_time:,.0f} samples/s")
            if self.window_flops_share > 0:
                parts.append(f"MFU {100 * self.window_flops_share / self.window_time:.3g}%")
        done = self.step - self.first_step
        if done > 0 and self.step < self.stop:
            parts.append("ETA " + format_duration(
                (now - self.started) / done * (self.stop - self.step)))
        return ", ".join(parts)

    def update_to(self, step: int) -> None:
        """Move to ``step`` (after a rollback)."""
        self.step = step
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
