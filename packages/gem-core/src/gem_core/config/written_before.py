"""What a stored configuration means where it lacks a key added since it was written.

A checkpoint's configuration and a run directory's ``config.toml`` hold every key of the
version that wrote them. A key added later is read at its default, which is what that version
did: except where the default is not the behaviour before the key, listed here once with the
value that version's models had. Without this, a run trained before ``model.numeric_scale``
existed (numbers read as they are) would be scored, resumed or distilled with its numbers
read through the signed log, by a model that never saw them that way.
"""

from __future__ import annotations

import copy
from typing import Any

#: ``(section, key)`` -> the value a stored configuration without the key means.
BEHAVIOUR_BEFORE_THE_KEY: dict[tuple[str, str], Any] = {
    # numbers were projected as they came before the signed log (2026-12-06)
    ("model", "numeric_scale"): "none",
    # the cross branch opened through a gate before its heads could open it (2026-12-05)
    ("model", "cross_branch_opening"): "gate",
    # id_bias's offsets were stepped at a constant rate before the per-id posterior (2026-12-06)
    ("model", "id_bias_step"): "constant",
}


def as_written(stored: dict[str, Any]) -> dict[str, Any]:
    """``stored`` (an unstructured configuration read from a checkpoint or a run directory)
    with each key of :data:`BEHAVIOUR_BEFORE_THE_KEY` it lacks set to what the version that
    wrote it did; the keys it has are kept, and ``stored`` itself is not changed."""
    filled = copy.deepcopy(stored)
    for (section, key), value in BEHAVIOUR_BEFORE_THE_KEY.items():
        table = filled.get(section)
        if isinstance(table, dict) and key not in table:
            table[key] = value
    return filled
