"""The resident memory of a process together with its descendants, sampled (Linux ``/proc``): what
``gem bench import`` reports for an engine that works in other processes too, Spark (its JVM
and the JVM's Python workers). ``ru_maxrss`` sees only one process, and its children only once
they have exited and been waited for, so it cannot see the JVM while the import runs.

A sample sums the resident set of the process and of every process below it at that moment; the
peak is the largest sum seen. It can miss a spike shorter than the sampling interval, so it is a
lower bound of the true peak (:class:`TreePeak` reports the interval with it).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _processes() -> dict[int, tuple[int, str, int]]:
    """Every process now: pid -> (parent pid, command name, resident bytes)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            resident = int((entry / "statm").read_text().split()[1]) * _PAGE
        except (OSError, IndexError, ValueError):  # it exited while being read
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:]
        found[int(entry.name)] = (int(rest.split()[1]), name, resident)
    return found


def tree_rss(root: int) -> dict[str, int]:
    """Resident bytes of ``root`` (``self``) and of its descendants, summed by kind: ``jvm``
    (command ``java``), ``other`` (the rest: Spark's Python workers, ...)."""
    processes = _processes()
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in processes.items():
        children.setdefault(parent, []).append(pid)
    sums = {"self": processes.get(root, (0, "", 0))[2], "jvm": 0, "other": 0}
    pending = list(children.get(root, []))
    while pending:
        pid = pending.pop()
        _, name, resident = processes[pid]
        sums["jvm" if name == "java" else "other"] += resident
        pending += children.get(pid, [])
    return sums


class TreePeak:
    """A thread sampling :func:`tree_rss` of this process every ``interval`` seconds while the
    ``with`` block runs: ``peak`` (the largest sum), ``parts`` (the largest of each kind)."""

    def __init__(self, interval: float = 0.2) -> None:
        self.interval = interval
        self.peak = 0
        self.parts = {"self": 0, "jvm": 0, "other": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def sample(self) -> None:
        sums = tree_rss(os.getpid())
        self.peak = max(self.peak, sum(sums.values()))
        self.parts = {kind: max(self.parts[kind], value) for kind, value in sums.items()}

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> TreePeak:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
