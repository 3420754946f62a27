"""String categories at import (``[import.strings]``): text values to stable 64-bit ids.

``hash``: the id of a text is the first 8 bytes of its BLAKE2b digest
(``hashlib.blake2b(text.encode("utf-8"), digest_size=8)``, no key), read as a little-endian
unsigned 64-bit number and stored as the int64 of those bits. Stable across runs, machines and
versions (no per-process seed); the table's id policy (``hash``, ``modulo``, ``managed``) then
maps the id to a row as for any 64-bit id. Distinct texts with one id are reported: the import
stops rather than merge two categories. The numpy engine sees each column whole; an engine that
reads the logs in blocks stages every block's distinct (id, text) pairs (:class:`HashedTexts`)
and finds two texts with one id across blocks, naming the pair the numpy engine names.

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


def same_hash(where: str, first: str, second: str, value: int) -> str:
    """The error of two texts with one ``hash`` id: ``first`` met before ``second``."""
    return (f"{where}texts {first!r} and {second!r} have the same 64-bit hash id {value}; use "
            "import.strings = \"vocabulary\" for this table")


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
        raise GemDataError(same_hash(where, values[same], values[other], int(ids[other])))
    result = np.zeros(len(texts), dtype=np.int64)
    if ids.size:
        index = np.asarray(pc.fill_null(pc.index_in(texts, value_set=pa.array(values, pa.string())),
                                        -1).to_numpy(zero_copy_only=False), dtype=np.int64)
        result = np.where(index >= 0, ids[np.maximum(index, 0)], 0)
    return result


#: Bits of a ``hash`` id (its top ones) that choose the bucket :class:`HashedTexts` stages its
#: texts in: one bucket of 64 is in memory at a time when the buckets are checked.
BUCKET_BITS = 6


class HashedTexts:
    """The distinct (id, text) pairs of ``hash`` columns read in blocks, staged to Parquet files
    in ``directory`` by the id's top :data:`BUCKET_BITS` bits, so that two texts with one id
    are found in whichever blocks they are (:func:`string_ids` sees one block) while only a
    bucket of the pairs is in memory. :meth:`check` names the pair :func:`string_ids` names
    reading each column whole: the first column (by ``order``) with a collision, and in it the
    text met first with the id of the earliest text whose id was met before."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.columns: dict[str, list[Any]] = {}  # where: [index, order, texts met so far]
        self.writers: dict[int, Any] = {}
        self.parts: list[Path] = []

    def add(self, where: str, order: Any, texts: Any, ids: np.ndarray) -> None:
        """One block of the column ``where`` (the prefix of its errors, naming file and column;
        ``order``: where the numpy path checks it among the others): its texts (a pyarrow
        string array; nulls are not values) and their ids (as :func:`string_ids` gave them)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        texts = texts.combine_chunks() if isinstance(texts, pa.ChunkedArray) else texts
        entry = self.columns.setdefault(where, [len(self.columns), order, 0])
        entry[1] = min(entry[1], order)
        offset, entry[2] = entry[2], entry[2] + len(texts)
        distinct = pc.unique(texts.drop_null())
        if not len(distinct):
            return
        # Each distinct text's first place in the block: the order the column met them in.
        first = np.asarray(pc.index_in(distinct, value_set=texts).to_numpy(), dtype=np.int64)
        values = np.asarray(ids, dtype=np.int64)[first]
        bucket = values.view(np.uint64) >> np.uint64(64 - BUCKET_BITS)
        table = pa.table({"w": pa.array(np.full(first.size, entry[0], dtype=np.int32)),
                          "id": values, "text": distinct.cast(pa.string()),
                          "pos": first + offset})
        for b in np.unique(bucket):
            self._writer(int(b)).write_table(table.filter(pa.array(bucket == b)))

    def _writer(self, bucket: int) -> Any:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if bucket not in self.writers:
            self.directory.mkdir(parents=True, exist_ok=True)
            path = self.directory / f"bucket-{bucket}-{len(self.parts)}.parquet"
            self.parts.append(path)
            self.writers[bucket] = pq.ParquetWriter(path, pa.schema([
                ("w", pa.int32()), ("id", pa.int64()), ("text", pa.string()),
                ("pos", pa.int64())]))
        return self.writers[bucket]

    def check(self) -> None:
        """Raise GemDataError (:func:`same_hash`) if two texts added since the last check have
        one id in one column; the pairs checked are removed."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        from gem_core.errors import GemDataError

        for writer in self.writers.values():
            writer.close()
        self.writers.clear()
        found = []
        buckets: dict[str, list[Path]] = {}
        for path in self.parts:
            buckets.setdefault(path.name.split("-")[1], []).append(path)
        for paths in buckets.values():
            found += _collisions(pa.concat_tables([pq.read_table(p) for p in paths]))
            for path in paths:
                path.unlink()
        self.parts = []
        if found:
            names = {entry[0]: (entry[1], where) for where, entry in self.columns.items()}
            _, _, w, first, second, value = min(
                (names[w][0], pos, w, first, second, value)
                for w, pos, first, second, value in found)
            raise GemDataError(same_hash(names[w][1], first, second, value))


def _collisions(table: Any) -> list[tuple[int, int, str, str, int]]:
    """Per column and id with two texts in ``table`` (a bucket of :class:`HashedTexts`):
    ``(column, place of the second text met, first text, second text, id)``."""
    import pyarrow.compute as pc

    pairs = table.group_by(["w", "id", "text"]).aggregate([("pos", "min")])
    counts = pairs.group_by(["w", "id"]).aggregate([("text", "count")])
    twice = counts.filter(pc.greater(counts.column("text_count"), 1))
    if not twice.num_rows:
        return []
    rows = pairs.join(twice, keys=["w", "id"], join_type="inner").sort_by(
        [("w", "ascending"), ("id", "ascending"), ("pos_min", "ascending")]).to_pylist()
    found, group, first, met = [], None, "", 0
    for row in rows:
        key = (row["w"], row["id"])
        met = met + 1 if key == group else 1
        if met == 1:
            group, first = key, row["text"]
        elif met == 2:
            found.append((row["w"], row["pos_min"], first, row["text"], row["id"]))
    return found


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

    def id_of(self, text: str) -> int | None:
        """The id of one text, None when it is not in the vocabulary."""
        try:
            return FIRST_ID + self.values.index(text)
        except ValueError:
            return None

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
    from gem_data.manifest import read_manifest

    directory = Path(dataset)
    manifest = read_manifest(directory)
    entries = manifest.info.get("vocabularies") or {}
    if not entries:
        raise GemDataError(f"{directory}: the data set has no vocabularies (info.vocabularies "
                           "in its manifest is empty); it was not imported with "
                           "import.strings = \"vocabulary\"")
    return {table: read_vocabulary(directory, table, entry) for table, entry in entries.items()}


def read_vocabulary(directory: str | Path, table: str, entry: dict[str, Any]) -> Vocabulary:
    """The vocabulary of ``table`` in the data set ``directory``, whose manifest's
    ``info.vocabularies`` entry is ``entry``; its file checked against the size and SHA-256
    recorded there (GemDataError naming the file otherwise)."""
    from gem_core.errors import GemDataError
    from gem_data.manifest import confined_path, file_digest

    directory = Path(directory)
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
    return Vocabulary(table, data["values"], source=str(directory))
