"""What a training forward leaves for the trainer to read afterwards (a loss of the model's own,
per-step counts), kept on the module that computed it.

These values are tensors of the forward's graph, so ``copy.deepcopy`` refuses them, and a model
is deep-copied after training forwards: evaluation replicas, TorchRec's sharders and the
reference of a distributed test all copy it. A copy therefore starts empty, as a module that has
not run a forward yet. The one rule lives here; each module names its own fields.
"""

from __future__ import annotations

from typing import Any


class LastForward:
    """Fields set by the last training forward; a deep copy holds the empty values given at
    construction (``LastForward(loss=None)``), never the source's tensors."""

    def __init__(self, **empty: Any) -> None:
        object.__setattr__(self, "_empty", dict(empty))
        self.clear()

    def clear(self) -> None:
        """Back to the empty values (a fresh copy of each, so no two holders share a dict)."""
        for name, value in self._empty.items():
            object.__setattr__(self, name, _fresh(value))

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._empty:  # a typo would otherwise be read back as the empty value
            raise AttributeError(f"LastForward has no field {name!r}; it has "
                                 f"{', '.join(sorted(self._empty))}")
        object.__setattr__(self, name, value)

    def __deepcopy__(self, memo: dict) -> LastForward:
        return LastForward(**self._empty)


def _fresh(value: Any) -> Any:
    return type(value)() if isinstance(value, (dict, list)) else value
