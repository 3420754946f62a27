"""How the ``parquet`` source applies ``[data]`` to a data set: whose ``max_seq_len`` caps the
histories (the data set's own, or the user's) and how many eval requests are scored, each said
once in the log (see ``DataConfig.data_set_wins``)."""

from __future__ import annotations

import logging
from pathlib import Path

import attrs

from gem_core.config import DataConfig

log = logging.getLogger(__name__)


def applied_data_config(given: DataConfig, data_set_max_seq_len: int) -> DataConfig:
    """``given`` with the data set's own values where ``given.data_set_wins`` names them: its
    ``max_seq_len``, and no ``eval_rows`` cap (the whole eval split). A ``max_seq_len`` the user
    chose applies, cut to the data set's when longer (its histories hold no more events)."""
    wins = given.data_set_wins
    if "max_seq_len" in wins:
        max_seq_len = data_set_max_seq_len
    else:
        max_seq_len = min(given.max_seq_len, data_set_max_seq_len)
    eval_rows = None if "eval_rows" in wins else given.eval_rows
    return attrs.evolve(given, max_seq_len=max_seq_len, eval_rows=eval_rows, data_set_wins=())


def log_applied(given: DataConfig, applied: DataConfig, data_set_max_seq_len: int,
                directory: Path) -> None:
    """One line on which ``max_seq_len`` applies and why; one more when a preset's (or the
    default) ``eval_rows`` gives way to the whole eval split."""
    if "max_seq_len" in given.data_set_wins:
        log.info("data.max_seq_len = %d from the data set's manifest (%s; the preset's or default "
                 "%d does not apply; --set data.max_seq_len to choose)", applied.max_seq_len,
                 directory, given.max_seq_len)
    elif given.max_seq_len > data_set_max_seq_len:
        log.info("data.max_seq_len = %d, the data set's (%s): its histories hold at most %d "
                 "events, fewer than the configured %d", applied.max_seq_len, directory,
                 data_set_max_seq_len, given.max_seq_len)
    else:
        log.info("data.max_seq_len = %d as configured (by --set or a config file; the data set "
                 "%s has %d)", applied.max_seq_len, directory, data_set_max_seq_len)
    if "eval_rows" in given.data_set_wins and given.eval_rows is not None:
        log.info("data.eval_rows: evaluations score the whole eval split; the preset's %d does "
                 "not apply (--set data.eval_rows to score only the first requests)",
                 given.eval_rows)
