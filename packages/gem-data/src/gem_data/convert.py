"""``gem data convert OLD --out NEW``: rewrite a format 1 data set as format 2.

Format 1 had one row per impression with fixed columns: ``history_item_id``,
``history_action``, ``history_timestamp`` (+ ``history_dense``), ``request_timestamp``,
``candidate_item_id``, scalar ``candidate.<name>`` and ``label.<task>``, ``sparse.<name>``,
``dense``, fixed-size ``candidate_dense`` and ``user_embedding``; its manifest schema named
``num_items`` and ``num_actions``. The conversion is columnar (no per-row Python) and maps:

* tables: ``item`` (``num_items``), ``action`` (``num_actions``), one per old candidate feature
  and one per old sparse feature (named like the feature), all with the ``dense`` id policy
  (format 1 ids were already rows);
* event features ``item`` and ``action`` (from ``history_item_id``, ``history_action``);
* candidate features ``item`` (from ``candidate_item_id``, sharing the ``item`` table with the
  events) and each old ``candidate.<name>``; one candidate per request (``K = 1``): labels and
  candidate features become one-element lists, ``candidate_dense`` a list of ``seq_dense_dim``;
* ``user_id``: format 1 stored no user, so each request gets its own key, its index in the data
  set (train rows first, then eval). Per-user metrics (GAUC) then have no user with more than
  one impression and report no groups; set real user keys if you have them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gem_core.errors import GemDataError
from gem_core.schema import ContextFeature, EmbeddingTable, FeatureSchema, SequenceFeature
from gem_data import format as fmt
from gem_data.arrow_io import list_parts, scalar_parts, single_array
from gem_data.manifest import MANIFEST_NAME, Manifest
from gem_data.writer import DatasetWriter


def v1_schema(data: dict[str, Any]) -> FeatureSchema:
    """The format 2 schema of a format 1 manifest's ``schema``."""
    try:
        candidates = data.get("candidate_features", [])
        sparse = data.get("sparse_features", [])
        taken = {"item", "action"}
        clash = sorted({f["name"] for f in candidates + sparse} & taken)
        if clash:
            raise GemDataError(f"format 1 features named {clash} clash with the converted "
                               "'item' and 'action' tables; rename them first")
        tables = [EmbeddingTable(name="item", num_embeddings=int(data["num_items"])),
                  EmbeddingTable(name="action", num_embeddings=int(data["num_actions"]))]
        tables += [EmbeddingTable(name=f["name"], num_embeddings=int(f["num_embeddings"]))
                   for f in candidates + sparse]
        return FeatureSchema(
            tables=tables,
            event_features=[SequenceFeature(name="item", table="item"),
                            SequenceFeature(name="action", table="action")],
            candidate_features=[SequenceFeature(name="item", table="item")]
            + [SequenceFeature(name=f["name"], table=f["name"]) for f in candidates],
            sparse_features=[ContextFeature(name=f["name"], table=f["name"],
                                            pooling=f.get("pooling", "sum")) for f in sparse],
            num_dense=int(data.get("num_dense", 0)),
            seq_dense_dim=int(data.get("seq_dense_dim", 0)),
            candidate_content=bool(data.get("candidate_content", False)),
            tasks=tuple(data["tasks"]),
            user_embedding_dim=int(data.get("user_embedding_dim", 0)),
            max_seq_len=int(data["max_seq_len"]),
        )
    except (KeyError, TypeError, ValueError) as error:
        if isinstance(error, GemDataError):
            raise
        raise GemDataError(f"not a format 1 schema ({type(error).__name__}: {error})") from None


def _one_each(values: np.ndarray, value_type: Any, width: int = 1) -> Any:
    """A list column with ``width`` values per row (one candidate per request)."""
    rows = values.size // width
    offsets = (np.arange(rows + 1, dtype=np.int64) * width).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, value_type))


def convert_table(table: Any, schema: FeatureSchema, first_user: int) -> Any:
    """One format 1 table as a format 2 table of ``schema``."""
    n = table.num_rows
    columns: dict[str, Any] = {
        fmt.USER_ID: pa.array(np.arange(first_user, first_user + n, dtype=np.int64)),
        fmt.REQUEST_TIMESTAMP: single_array(table.column("request_timestamp")),
        fmt.HISTORY_TIMESTAMP: single_array(table.column("history_timestamp")),
        fmt.event_column("item"): single_array(table.column("history_item_id")),
        fmt.event_column("action"): single_array(table.column("history_action")),
    }
    if schema.seq_dense_dim:
        columns[fmt.HISTORY_DENSE] = single_array(table.column("history_dense"))
    columns[fmt.candidate_column("item")] = _one_each(
        scalar_parts(table.column("candidate_item_id")), pa.int64())
    for f in schema.candidate_features[1:]:
        columns[fmt.candidate_column(f.name)] = _one_each(
            scalar_parts(table.column(f"candidate.{f.name}")), pa.int64())
    for task in schema.tasks:
        columns[fmt.label_column(task)] = _one_each(
            scalar_parts(table.column(f"label.{task}")), pa.float32())
    if schema.candidate_content:
        flat, _ = list_parts(table.column("candidate_dense"))
        columns[fmt.CANDIDATE_DENSE] = _one_each(flat, pa.float32(), schema.seq_dense_dim)
    for f in schema.sparse_features:
        columns[fmt.sparse_column(f.name)] = single_array(table.column(fmt.sparse_column(f.name)))
    if schema.num_dense:
        columns[fmt.DENSE] = single_array(table.column(fmt.DENSE))
    if schema.user_embedding_dim:
        columns[fmt.USER_EMBEDDING] = single_array(table.column(fmt.USER_EMBEDDING))
    target = fmt.arrow_schema(schema)
    return pa.Table.from_arrays([columns[f.name].cast(f.type) for f in target], schema=target)


def convert_v1(old: str | Path, out: str | Path) -> Manifest:
    """Rewrite the format 1 data set ``old`` as format 2 in ``out`` (same splits, same row
    groups); its manifest."""
    old, out = Path(old), Path(out)
    path = old / MANIFEST_NAME
    if not path.is_file():
        raise GemDataError(f"{path} is missing: {old} is not a GEM data set")
    if old.resolve() == out.resolve():
        raise GemDataError("convert writes a new data set: --out must be another directory")
    data = json.loads(path.read_text())
    version = data.get("format_version")
    if version == fmt.FORMAT_VERSION:
        raise GemDataError(f"{old} is already format {fmt.FORMAT_VERSION}")
    if version not in (1, None):
        raise GemDataError(f"{path}: unknown format_version {version!r}")
    schema = v1_schema(data["schema"])
    info = {"converted_from": str(old), "converted_from_format": 1,
            "user_id": "request index (format 1 stored no user id)",
            "original_info": data.get("info", {})}
    # Each old row group becomes one new row group (so shards and resume units stay alike).
    largest = max((max(f["row_groups"]) for split in data["splits"].values()
                   for f in split["files"] if f["row_groups"]), default=16384)
    writer = DatasetWriter(out, schema, row_group_rows=largest, info=info)
    user = 0
    for split in ("train", "eval"):
        for entry in data["splits"].get(split, {}).get("files", []):
            handle = pq.ParquetFile(old / entry["path"])
            for index in range(handle.metadata.num_row_groups):
                table = convert_table(handle.read_row_group(index), schema, user)
                user += table.num_rows
                writer.write(split, table)
    return writer.close()
