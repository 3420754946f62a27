"""String categories at import (``[import.strings]``): text values to stable 64-bit ids.

``hash``: the id of a text is the first 8 bytes of its BLAKE2b digest
(``hashlib.blake2b(text.encode("utf-8"), digest_size=8)``, no key), read as a little-endian
unsigned 64-bit number and stored as the int64 of those bits. Stable across runs, machines and
versions (no per-process seed); the table's id policy (``hash``, ``modulo``, ``managed``) then
maps the id to a row as for any 64-bit id. Distinct texts with one id are reported: the import
stops rather than merge two categories.

``vocabulary``: the distinct texts seen at import, sorted (by code point, which is the order of
their UTF-8 bytes), get ids ``2, 3, ...``; id 0 is the reserved row of missing values (the
default of ``missing = "default"``) and id 1 that of values not in the vocabulary (a later
import reusing it with ``--vocabulary-from``). The vocabulary is written with the data set
(``vocabulary.<table>.json``, listed with its size and SHA-256 in the manifest's
``info.vocabularies``).

Integers are taken as their decimal text under both (``7`` and ``"7"`` are one value), so a CSV
and a Parquet log of the same data give the same ids.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

MISSING_ID = 0
"""The id of a missing value in a ``vocabulary`` table (its reserved row)."""

OUT_OF_VOCABULARY_ID = 1
"""The id of a value not in the vocabulary (seen only at a later import)."""

FIRST_ID = 2
"""The id of the vocabulary's first value."""


def string_id(text: str) -> int:
    """The ``hash`` id of one text, as a signed int64 (the bits of the unsigned digest)."""
    value = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(),
                           "little")
    return value - (1 << 64) if value >= 1 << 63 else value


def string_ids(texts: Any, where: str = "") -> np.ndarray:
    """The ``hash`` ids of a pyarrow string array (nulls give 0, for the caller to fill).
    Hashes each distinct text once; two texts with one id raise GemDataError."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from gem_core.errors import GemDataError

    distinct = pc.unique(texts.drop_null() if hasattr(texts, "drop_null") else texts)
    values = [v for v in distinct.to_pylist() if v is not None]
    ids = np.array([string_id(v) for v in values], dtype=np.int64)
    unique_ids, first = np.unique(ids, return_index=True)
    if unique_ids.size != ids.size:
        seen = np.zeros(ids.size, dtype=bool)
        seen[first] = True
        other = int(np.flatnonzero(~seen)[0])
        same = int(np.flatnonzero(ids == ids[other])[0])
        raise GemDataError(f"{where}texts {values[same]!r} and {values[other]!r} have the same "
                           f"64-bit hash id {int(ids[other])}; use import.strings = "
                           "\"vocabulary\" for this table")
    result = np.zeros(len(texts), dtype=np.int64)
    if ids.size:
        index = np.asarray(pc.fill_null(pc.index_in(texts, value_set=pa.array(values, pa.string())),
                                        -1).to_numpy(zero_copy_only=False), dtype=np.int64)
        result = np.where(index >= 0, ids[np.maximum(index, 0)], 0)
    return result


class Vocabulary:
    """A table's vocabulary: sorted distinct texts, the ``i``-th with id ``FIRST_ID + i``."""

    def __init__(self, table: str, values: list[str], source: str | None = None) -> None:
        self.table, self.values, self.source = table, list(values), source

    @classmethod
    def build(cls, table: str, arrays: list[Any]) -> Vocabulary:
        """The vocabulary of the texts (pyarrow string arrays, nulls ignored) of ``arrays``."""
        import pyarrow as pa
        import pyarrow.compute as pc

        if not arrays:
            return cls(table, [])
        merged = pa.chunked_array([a.cast(pa.string()) for a in arrays], pa.string())
        return cls(table, sorted(v for v in pc.unique(merged).to_pylist() if v is not None))

    @property
    def size(self) -> int:
        """Ids it uses: the values and the two reserved rows."""
        return FIRST_ID + len(self.values)

    def ids(self, texts: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, out_of_vocabulary)`` of a pyarrow string array: nulls get :data:`MISSING_ID`
        (for the caller to fill), unknown texts :data:`OUT_OF_VOCABULARY_ID`."""
        import pyarrow as pa
        import pyarrow.compute as pc

        index = pc.index_in(texts, value_set=pa.array(self.values, pa.string()))
        null = np.asarray(pc.is_null(texts).to_numpy(zero_copy_only=False), dtype=bool)
        unknown = np.asarray(pc.is_null(index).to_numpy(zero_copy_only=False), dtype=bool) \
            & ~null
        ids = np.asarray(pc.fill_null(index, -FIRST_ID).to_numpy(zero_copy_only=False),
                         dtype=np.int64) + FIRST_ID
        ids[unknown] = OUT_OF_VOCABULARY_ID
        ids[null] = MISSING_ID
        return ids, unknown

    # -- file ----------------------------------------------------------------------------------

    @staticmethod
    def file_name(table: str) -> str:
        return f"vocabulary.{table}.json"

    def write(self, directory: Path) -> dict[str, Any]:
        """Write ``vocabulary.<table>.json`` into ``directory``; its manifest entry (path, size,
        SHA-256, values)."""
        from gem_data.manifest import file_digest

        path = directory / self.file_name(self.table)
        path.write_text(json.dumps({"table": self.table, "reserved": {
            "missing": MISSING_ID, "out_of_vocabulary": OUT_OF_VOCABULARY_ID},
            "first_id": FIRST_ID, "values": self.values}, ensure_ascii=False) + "\n",
            encoding="utf-8")
        entry = {"path": path.name, "size": path.stat().st_size, "sha256": file_digest(path),
                 "values": len(self.values)}
        if self.source:
            entry["from"] = self.source
        return entry


def read_vocabularies(dataset: str | Path) -> dict[str, Vocabulary]:
    """The vocabularies a data set was imported with (``--vocabulary-from``), each file checked
    against the size and SHA-256 its manifest records."""
    from gem_core.errors import GemDataError
    from gem_data.manifest import confined_path, file_digest, read_manifest

    directory = Path(dataset)
    manifest = read_manifest(directory)
    entries = manifest.info.get("vocabularies") or {}
    if not entries:
        raise GemDataError(f"{directory}: the data set has no vocabularies (info.vocabularies "
                           "in its manifest is empty); it was not imported with "
                           "import.strings = \"vocabulary\"")
    result = {}
    for table, entry in entries.items():
        path = confined_path(directory, entry["path"], where=f"{directory}: vocabulary {table!r}")
        if not path.is_file():
            raise GemDataError(f"{path}: the vocabulary of table {table!r} is missing")
        if path.stat().st_size != entry.get("size") or file_digest(path) != entry.get("sha256"):
            raise GemDataError(f"{path}: the vocabulary of table {table!r} differs from the one "
                               "its manifest records (size or SHA-256); it was changed or "
                               "damaged")
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("first_id") != FIRST_ID:
            raise GemDataError(f"{path}: first_id {data.get('first_id')!r} is not {FIRST_ID}")
        result[table] = Vocabulary(table, data["values"], source=str(directory))
    return result
