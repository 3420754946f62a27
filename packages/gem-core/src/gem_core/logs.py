"""Structured logging: one line per event, human-readable or JSON for machines."""

from __future__ import annotations

import json
import logging
import os
import sys


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


def configure_logging(level: str, log_format: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        rank = os.environ.get("RANK")
        prefix = f"[rank {rank}] " if rank is not None else ""
        handler.setFormatter(logging.Formatter(
            f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
