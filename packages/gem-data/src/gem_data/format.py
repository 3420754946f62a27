"""The on-disk layout of a GEM data set: one Parquet row per impression, list columns for histories.

Column names are derived from the :class:`~gem_core.schema.FeatureSchema` so that a schema alone
says what a file must hold. Ids are int64 and floats float32 on disk, the dtypes of
:class:`~gem_core.batch.JaggedBatch`, so reading hands pyarrow's buffers to torch without a cast.

=========================  =============================  ==========================================
column                     arrow type                     meaning
=========================  =============================  ==========================================
``history_item_id``        ``list<int64>``                item of each history event, oldest first
``history_action``         ``list<int64>``                action type of each event
``history_timestamp``      ``list<int64>``                event time in seconds
``history_dense``          ``list<float32>``              ``seq_dense_dim`` floats per event (opt.)
``request_timestamp``      ``int64``                      impression time
``candidate_item_id``      ``int64``                      the candidate ad's item
``candidate.<name>``       ``int64``                      each candidate feature
``sparse.<name>``          ``list<int64>``                each multi-hot sparse feature
``dense``                  ``fixed_size_list<float32>``   ``num_dense`` floats (when > 0)
``label.<task>``           ``float32``                    each task's label in {0, 1}
``candidate_dense``        ``fixed_size_list<float32>``   candidate content vector (when declared)
``user_embedding``         ``fixed_size_list<float32>``   upstream user embedding (exported sets)
=========================  =============================  ==========================================
"""

from __future__ import annotations

from typing import Any

from gem_core.schema import FeatureSchema, SparseFeature

HISTORY_ITEM = "history_item_id"
HISTORY_ACTION = "history_action"
HISTORY_TIMESTAMP = "history_timestamp"
HISTORY_DENSE = "history_dense"
REQUEST_TIMESTAMP = "request_timestamp"
CANDIDATE_ITEM = "candidate_item_id"
DENSE = "dense"
USER_EMBEDDING = "user_embedding"
CANDIDATE_DENSE = "candidate_dense"

#: The history columns that share one length per row (``history_dense`` has ``dim`` x that).
HISTORY_ID_COLUMNS = (HISTORY_ITEM, HISTORY_ACTION, HISTORY_TIMESTAMP)


def sparse_column(name: str) -> str:
    return f"sparse.{name}"


def candidate_column(name: str) -> str:
    return f"candidate.{name}"


def label_column(task: str) -> str:
    return f"label.{task}"


def arrow_schema(schema: FeatureSchema) -> Any:
    """The pyarrow schema every Parquet file of a data set with ``schema`` has, in this order."""
    import pyarrow as pa

    ids = pa.list_(pa.int64())
    fields = [
        pa.field(HISTORY_ITEM, ids, nullable=False),
        pa.field(HISTORY_ACTION, ids, nullable=False),
        pa.field(HISTORY_TIMESTAMP, ids, nullable=False),
    ]
    if schema.seq_dense_dim:
        fields.append(pa.field(HISTORY_DENSE, pa.list_(pa.float32()), nullable=False))
    fields += [
        pa.field(REQUEST_TIMESTAMP, pa.int64(), nullable=False),
        pa.field(CANDIDATE_ITEM, pa.int64(), nullable=False),
    ]
    fields += [pa.field(candidate_column(f.name), pa.int64(), nullable=False)
               for f in schema.candidate_features]
    fields += [pa.field(sparse_column(f.name), ids, nullable=False) for f in schema.sparse_features]
    if schema.num_dense:
        fields.append(pa.field(DENSE, pa.list_(pa.float32(), schema.num_dense), nullable=False))
    fields += [pa.field(label_column(t), pa.float32(), nullable=False) for t in schema.tasks]
    if schema.candidate_content:
        fields.append(pa.field(CANDIDATE_DENSE, pa.list_(pa.float32(), schema.seq_dense_dim),
                               nullable=False))
    if schema.user_embedding_dim:
        fields.append(pa.field(USER_EMBEDDING, pa.list_(pa.float32(), schema.user_embedding_dim),
                               nullable=False))
    return pa.schema(fields)


def id_spaces(schema: FeatureSchema) -> dict[str, int]:
    """Per id column, the size of its id space (valid ids are ``0 .. size - 1``)."""
    spaces = {HISTORY_ITEM: schema.num_items, HISTORY_ACTION: schema.num_actions,
              CANDIDATE_ITEM: schema.num_items}
    spaces.update({candidate_column(f.name): f.num_embeddings for f in schema.candidate_features})
    spaces.update({sparse_column(f.name): f.num_embeddings for f in schema.sparse_features})
    return spaces


def schema_to_dict(schema: FeatureSchema) -> dict[str, Any]:
    """JSON-ready form of a schema, for the manifest."""
    return {
        "num_items": schema.num_items,
        "num_actions": schema.num_actions,
        "sparse_features": [_feature_dict(f) for f in schema.sparse_features],
        "candidate_features": [_feature_dict(f) for f in schema.candidate_features],
        "num_dense": schema.num_dense,
        "seq_dense_dim": schema.seq_dense_dim,
        "tasks": list(schema.tasks),
        "max_seq_len": schema.max_seq_len,
        "candidate_content": schema.candidate_content,
        "user_embedding_dim": schema.user_embedding_dim,
    }


def schema_from_dict(data: dict[str, Any]) -> FeatureSchema:
    return FeatureSchema(
        num_items=int(data["num_items"]),
        num_actions=int(data["num_actions"]),
        sparse_features=[SparseFeature(**f) for f in data.get("sparse_features", [])],
        candidate_features=[SparseFeature(**f) for f in data.get("candidate_features", [])],
        num_dense=int(data.get("num_dense", 0)),
        seq_dense_dim=int(data.get("seq_dense_dim", 0)),
        tasks=tuple(data["tasks"]),
        max_seq_len=int(data["max_seq_len"]),
        candidate_content=bool(data.get("candidate_content", False)),
        user_embedding_dim=int(data.get("user_embedding_dim", 0)),
    )


def _feature_dict(feature: SparseFeature) -> dict[str, Any]:
    return {"name": feature.name, "num_embeddings": feature.num_embeddings,
            "pooling": feature.pooling}
