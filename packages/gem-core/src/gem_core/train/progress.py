"""The terminal progress bar: only on rank 0 and only when stderr is a terminal."""

from __future__ import annotations

import sys
from typing import Any


class Progress:
    def __init__(self, *, total: int, initial: int, enabled: bool) -> None:
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                            file=sys.stderr)

    def update(self, record: dict[str, Any]) -> None:
        if self.bar is None:
            return
        self.bar.set_postfix(loss=f"{record['loss']:.4f}",
                             samples_s=f"{record['samples_per_s']:.0f}",
                             tokens_s=f"{record['tokens_per_s']:.0f}", refresh=False)
        self.bar.update(1)

    def update_to(self, step: int) -> None:
        """Move the bar to ``step`` (after a rollback)."""
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
