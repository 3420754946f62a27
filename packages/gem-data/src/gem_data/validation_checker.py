"""What a failed check does to one row group: raise, or mark the requests to drop, and count.

Every check reports its bad rows here rather than acting on them itself, so the policy of each
check (``[data.options.validation]``) is applied in one place, a request dropped by two checks
is counted once (under the first), and every error has the same wording: where (file, row
group, row), what (feature and value), how many rows of the group share the fault and the
option that made it an error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from gem_core.errors import GemDataError

if TYPE_CHECKING:
    from gem_data.validation import Location, ValidationPolicy

#: The checks, in the order they run; each is also its policy's key.
CHECKS = ("structure", "ids", "dense", "labels", "time")


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
