"""What a stored configuration means where it lacks a key added since it was written, or
holds one removed since.

A checkpoint's configuration and a run directory's ``config.toml`` hold every key of the
version that wrote them. A key added later is read at its default, which is what that version
did: except where the default is not the behaviour before the key, listed here once with the
value that version's models had. Without this, a run trained before ``model.numeric_scale``
existed (numbers read as they are) would be scored, resumed or distilled with its numbers
read through the signed log, by a model that never saw them that way.

A key removed since (an option measured and taken out) is dropped where the stored value is
the one that left the model as today's builds it; any other value names the option and
stops: this version cannot rebuild that model, and reading it without the option would score
another one. Without this, every run written before a removal fails to load with "unknown
key", and ``gem runs seeds`` cannot compare it with runs written after.
"""

from __future__ import annotations

import copy
from typing import Any

from gem_core.errors import GemConfigError

#: ``(section, key)`` -> the value a stored configuration without the key means.
BEHAVIOUR_BEFORE_THE_KEY: dict[tuple[str, str], Any] = {
    # numbers were projected as they came before the signed log (2026-12-06)
    ("model", "numeric_scale"): "none",
    # the cross branch opened through a gate before its heads could open it (2026-12-05)
    ("model", "cross_branch_opening"): "gate",
    # id_bias's offsets were stepped at a constant rate before the per-id posterior (2026-12-06)
    ("model", "id_bias_step"): "constant",
}


#: ``(section, key)`` of a removed option -> the value at which a model built with it is the
#: model this version builds without it.
REMOVED_KEYS: dict[tuple[str, str], Any] = {
    # measured worse on multi_valued and hierarchy (2026-12-07)
    ("model", "target_match_latest_counts"): False,
    # hid exact matches from a share of the training candidates; no gain (2026-12-07)
    ("model", "target_match_dropout"): 0.0,
    # left named attributes out of target match; cost hierarchy and ads NE (2026-12-07)
    ("model", "target_match_skip"): [],
}


def as_written(stored: dict[str, Any]) -> dict[str, Any]:
    """``stored`` (an unstructured configuration read from a checkpoint or a run directory)
    with each key of :data:`BEHAVIOUR_BEFORE_THE_KEY` it lacks set to what the version that
    wrote it did, and each key of :data:`REMOVED_KEYS` it holds at its neutral value dropped
    (another value raises :class:`GemConfigError`); the other keys it has are kept, and
    ``stored`` itself is not changed."""
    filled = copy.deepcopy(stored)
    for (section, key), neutral in REMOVED_KEYS.items():
        table = filled.get(section)
        if not isinstance(table, dict) or key not in table:
            continue
        value = table.pop(key)
        if (list(value) if isinstance(value, tuple) else value) != neutral:  # JSON's tuples
            raise GemConfigError(
                f"{section}.{key} = {value!r}: the run was trained with an option this version "
                f"no longer has (only {neutral!r}, which leaves the model as this version "
                f"builds it, is read); use the version that wrote it")
    for (section, key), value in BEHAVIOUR_BEFORE_THE_KEY.items():
        table = filled.get(section)
        if isinstance(table, dict) and key not in table:
            table[key] = value
    return filled
