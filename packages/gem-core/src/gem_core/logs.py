"""Structured logging: one line per event, human-readable or JSON for machines.

In a process group only rank 0 logs everything: the other ranks log warnings and errors (every
level with ``DEBUG``, for debugging one rank), their text lines prefixed ``[rank N]``, so a
start-up or a progress line appears once, not once per rank. Python warnings are logged too.
"""

from __future__ import annotations

import json
import logging
import os
import sys

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, rank, message."""

    def format(self, record: logging.LogRecord) -> str:
        event = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname,
            "logger": record.name,
            "rank": int(os.environ.get("RANK", "0")),
            "message": record.getMessage(),
        }
        if record.exc_info:
            event["exception"] = self.formatException(record.exc_info)
        return json.dumps(event)


def rank_threshold(level: str, rank: int) -> int:
    """The lowest level a rank prints: ``level`` on rank 0; WARNING or above on the others,
    unless ``level`` is DEBUG (every rank's detail is then wanted)."""
    wanted = logging.getLevelName(level)
    if rank == 0 or wanted == logging.DEBUG:
        return wanted
    return max(wanted, logging.WARNING)


def text_format(rank: int) -> str:
    prefix = f"[rank {rank}] " if rank != 0 else ""
    return f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s"


def configure_logging(level: str, log_format: str, rank: int | None = None) -> None:
    """Send log records of ``level`` and above to stderr as ``text`` or ``json``; ``rank``
    (default: the ``RANK`` environment variable, 0 outside a process group) filters and
    prefixes as the module docstring says."""
    if level not in LEVELS or log_format not in FORMATS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)} and format one of "
                         f"{', '.join(FORMATS)}; got {level!r}, {log_format!r}")
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json"
                         else logging.Formatter(text_format(rank)))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(rank_threshold(level, rank))
    # Python warnings (a library's FutureWarning) become WARNING records: prefixed with their
    # rank like every other line, and silenced by --log-level ERROR.
    logging.captureWarnings(True)
    _current.update(level=level, format=log_format)


_current = {"level": "WARNING", "format": "text"}  # Python's own default until configured


def current_logging() -> tuple[str, str]:
    """The level and format the last :func:`configure_logging` asked for (what a launcher
    passes on to the processes it starts)."""
    return _current["level"], _current["format"]
