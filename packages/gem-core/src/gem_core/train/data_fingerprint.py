"""What data a checkpoint was trained on, so that a resume on other data is refused.

Each checkpoint's trainer state holds a fingerprint (plain strings and integers): the data
source, its path, a digest of ``[data]``'s options, ``train.seed`` (which also seeds generated
data, the evaluation split and the data order) and what the source itself says identifies its
content (:meth:`gem_core.data.DataSource.fingerprint`: a Parquet data set's manifest digest,
which changes when the data set is regenerated in place). A resume whose fingerprint differs is
refused unless the user passes ``--allow-data-change``.

One difference is not a change: a time-windowed source (:class:`gem_core.contracts.
WindowedSource`) lists its windows under ``windows`` (``"name=digest;..."``), and a data set that
gained windows after the checkpoint's is the same data, continued: the saved list must be the
start of the current one.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from gem_core.config import GemConfig
from gem_core.errors import GemConfigError

log = logging.getLogger(__name__)

#: Key of the fingerprint in the trainer state of a checkpoint.
STATE_KEY = "data_fingerprint"

#: Fields compared on resume; ``path`` is compared only for sources that report no content
#: digest of their own (a data set copied elsewhere with the same manifest is the same data).
_ALWAYS_COMPARED = ("source", "options_sha256", "seed")


def sha256_json(data: Any) -> str:
    """Digest of plain data, independent of key order."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def data_fingerprint(config: GemConfig, source_fingerprint: dict[str, str]) -> dict[str, Any]:
    """The fingerprint of this run's data; ``source_fingerprint`` comes from the data source
    (its keys are stored prefixed with ``content_``)."""
    path = config.data.path
    return {
        "source": config.data.source,
        "path": str(Path(path).resolve()) if path else "",
        "options_sha256": sha256_json(config.data.options),
        "seed": config.train.seed,
        **{f"content_{key}": str(value) for key, value in sorted(source_fingerprint.items())},
    }


def _compared(fingerprint: dict[str, Any]) -> list[str]:
    content = sorted(k for k in fingerprint if k.startswith("content_"))
    return [*_ALWAYS_COMPARED, *content] + ([] if content else ["path"])


def fingerprint_differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """``"field: before -> after"`` for each compared field of two fingerprints that differs
    (empty: the same data). Used by resume and by ``gem runs compare``."""
    keys = sorted(set(_compared(before)) | set(_compared(after)),
                  key=lambda k: (k not in _ALWAYS_COMPARED, k))
    return [f"{key}: {before.get(key, 'absent')!r} -> {after.get(key, 'absent')!r}"
            for key in keys if before.get(key) != after.get(key)]


WINDOWS_KEY = "content_windows"
"""The fingerprint field of a time-windowed source's windows, compared as a prefix."""


def windows_continued(before: dict[str, Any], after: dict[str, Any]) -> bool:
    """Whether ``after``'s windows are ``before``'s followed by new ones (or the same)."""
    old, new = before.get(WINDOWS_KEY), after.get(WINDOWS_KEY)
    if not isinstance(old, str) or not isinstance(new, str):
        return False
    old_list, new_list = old.split(";"), new.split(";")
    return new_list[:len(old_list)] == old_list


def check_same_data(saved: dict[str, Any] | None, current: dict[str, Any], checkpoint: Path, *,
                    allow_change: bool) -> None:
    """Refuse (:class:`GemConfigError` naming each difference and ``--allow-data-change``) to
    resume the checkpoint at ``checkpoint`` on data other than it was trained on; with
    ``allow_change`` the differences are logged and the run goes on."""
    if saved is None:
        log.warning("%s holds no data fingerprint (written before they were recorded): "
                    "cannot check that this run resumes on the same data", checkpoint)
        return
    changed = fingerprint_differences(saved, current)
    if windows_continued(saved, current):
        added = len(current[WINDOWS_KEY].split(";")) - len(saved[WINDOWS_KEY].split(";"))
        changed = [c for c in changed if not c.startswith(f"{WINDOWS_KEY}:")]
        if added and not changed:
            log.info("the data set has %d window(s) more than %s was trained on: continuing "
                     "with them", added, checkpoint)
    if not changed:
        return
    what = "; ".join(changed)
    if allow_change:
        log.warning("%s was trained on other data (%s); continuing on the new data as "
                    "--allow-data-change asks", checkpoint, what)
        return
    raise GemConfigError(
        f"{checkpoint} was trained on other data than this run would resume on ({what}). "
        "train.seed also seeds generated data, the evaluation split and the data order, and a "
        "data set regenerated in place has another manifest. Resume with the same data and "
        "seed, pass --allow-data-change to continue on the new data on purpose, or use "
        "--fresh / another --out to start over")
