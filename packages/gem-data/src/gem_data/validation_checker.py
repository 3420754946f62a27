"""What a failed check does to one row group: raise, or mark the requests to drop, and count.

Every check reports its bad rows here rather than acting on them itself, so the policy of each
check (``[data.options.validation]``) is applied in one place, a request dropped by two checks
is counted once (under the first), and every error has the same wording: where (file, row
group, row), what (feature and value), how many rows of the group share the fault and the
option that made it an error.
"""

from __future__ import annotations

from typing import Callable

import attrs
import numpy as np

from gem_core.config.validators import choice
from gem_core.errors import GemDataError

#: The checks, in the order they run; each is also its policy's key.
CHECKS = ("structure", "ids", "dense", "labels", "time")


@attrs.frozen(kw_only=True)
class ValidationPolicy:
    """What to do with a request that fails a check (``[data.options.validation]``)."""

    structure: str = attrs.field(default="error", validator=choice("error", "drop"))
    """Nulls, lists of disagreeing lengths, no candidates, empty multi-valued id lists:
    ``error`` or ``drop``."""

    ids: str = attrs.field(default="error", validator=choice("error", "drop", "clamp"))
    """An id outside ``[0, size)`` of a ``dense``-policy table: ``error``, ``drop`` the
    request, or ``clamp`` the id."""

    dense: str = attrs.field(default="error", validator=choice("error", "drop", "clamp"))
    """A NaN or infinite dense value: ``error``, ``drop`` the request, or ``clamp`` it to 0."""

    labels: str = attrs.field(default="error", validator=choice("error", "drop"))
    """A label other than 0 or 1: ``error`` or ``drop`` the request."""

    time: str = attrs.field(default="error", validator=choice("error", "drop", "trim"))
    """A history event after its request or before ``time_floor``: ``error``, ``drop`` the
    request, or ``trim`` those events from the history. A request before ``time_floor`` or a
    history out of order is an error under ``error`` and dropped otherwise."""

    time_floor: int = attrs.field(default=0, validator=attrs.validators.instance_of(int))
    """Earliest plausible time, in the data's seconds since 1970-01-01 UTC: requests and events
    before it fail the ``time`` check (-2^62 and other placeholders). The default, 0, accepts
    any time from 1970 on; ``631152000`` is 1990-01-01. Data sets with relative times (seconds
    from the start of a log) keep 0."""


@attrs.frozen(kw_only=True)
class Location:
    """Where a row group lives, for error messages."""

    file: str
    row_group: int
    first_row: int
    """Index within the file of the row group's first row."""

    def row(self, row: int) -> str:
        return (f"{self.file}: row group {self.row_group}, row {self.first_row + row} "
                f"(row {row} of the group)")


class Checker:
    """The state of one row group's validation: drop mask, counts, and error wording."""

    def __init__(self, policy: ValidationPolicy, where: Location, n: int,
                 row_map: np.ndarray | None = None) -> None:
        self.policy, self.where, self.n = policy, where, n
        self.row_map = row_map
        """Per row checked, its row in the group (None: the same), when rows were dropped
        before: messages name the row of the file."""
        self.drop = np.zeros(n, dtype=bool)
        self.dropped = dict.fromkeys(CHECKS, 0)
        self.repaired = dict.fromkeys(CHECKS, 0)

    def original(self, row: int) -> int:
        return row if self.row_map is None else int(self.row_map[row])

    def reject(self, check: str, rows: np.ndarray, describe: Callable[[int], str]) -> None:
        """Raise for the first bad row under ``error``; else mark the rows to drop and count
        them. ``describe(row)`` words the feature and value of that row."""
        mode = getattr(self.policy, check)
        if mode == "error":
            row = int(np.flatnonzero(rows)[0])
            raise GemDataError(f"{self.where.row(self.original(row))}: {describe(row)} "
                               f"({int(rows.sum())} such rows in the group; "
                               f"data.options.validation.{check} = 'error')")
        self.dropped[check] += int((rows & ~self.drop).sum())
        self.drop |= rows

    def repair(self, check: str, rows: np.ndarray) -> None:
        self.repaired[check] += int((rows & ~self.drop).sum())
