"""The on-disk layout of a GEM data set (format 2): one Parquet row per **request**.

A row is one user's request: the history (events, oldest first, every event feature a list of
the same length), the request's context, and ``K >= 1`` candidates (every candidate feature and
label a list of ``K``). Column names follow the :class:`~gem_core.schema.FeatureSchema`, so a
schema alone says what a file must hold. Ids are int64 and floats float32 on disk, the dtypes of
:class:`~gem_core.batch.JaggedBatch`, so reading hands pyarrow's buffers to torch without a cast.
Id columns written as ``uint64`` by other tools are read as int64 with the same bits (a
zero-copy view): ids are opaque 64-bit keys, mapped to rows by their table's id policy.

========================  ===================================  ===================================
column                    arrow type                           meaning
========================  ===================================  ===================================
``user_id``               ``int64``                            raw user key (GAUC groups)
``request_timestamp``     ``int64``                            request time, seconds
``history_timestamp``     ``list<int64>``                      time of each event (E), oldest first
``event.<name>``          ``list<int64>``                      a single-valued event feature (E)
``event.<name>``          ``list<list<int64>>``                a multi-valued one (E lists, >= 1 id)
``history_dense``         ``list<float32>``                    ``E * seq_dense_dim`` (optional)
``candidate.<name>``      ``list<int64>`` / ``list<list<..>>`` each candidate feature (K >= 1)
``label.<task>``          ``list<float32>``                    label of each candidate (K), 0 or 1
``candidate_dense``       ``list<float32>``                    ``K * seq_dense_dim`` (optional)
``candidate_numeric``     ``list<float32>``                    ``K * candidate_numeric_dim``: each
                                                               candidate's numeric features, in
                                                               turn (optional)
``sparse.<name>``         ``list<int64>``                      a context feature's bag of ids
``dense``                 ``fixed_size_list<float32>[n]``      ``num_dense`` floats (optional)
``user_embedding``        ``fixed_size_list<float32>[u]``      upstream user embedding (exported)
``teacher_logit.<task>``  ``list<float32>``                    a teacher's logit per candidate (K)
``teacher_embedding``     ``fixed_size_list<float32>[t]``      a teacher's user embedding
========================  ===================================  ===================================

The two ``teacher_*`` columns come last and only in data sets written by ``gem
distill-precompute`` (the schema's ``teacher_tasks`` and ``teacher_embedding_dim``): the
teacher's signals for a student of ``gem distill --signals precomputed``. They are not features.

Format 1 (one row per impression: ``history_item_id``, ``history_action``, ``candidate_item_id``,
scalar ``candidate.<name>`` and ``label.<task>``) is read by no reader: ``gem data convert``
rewrites such a set as format 2 (:mod:`gem_data.convert`).
"""

from __future__ import annotations

from typing import Any, Iterator

from gem_core.schema import FeatureSchema, SequenceFeature

FORMAT_VERSION = 2

USER_ID = "user_id"
REQUEST_TIMESTAMP = "request_timestamp"
HISTORY_TIMESTAMP = "history_timestamp"
HISTORY_DENSE = "history_dense"
CANDIDATE_DENSE = "candidate_dense"
CANDIDATE_NUMERIC = "candidate_numeric"
DENSE = "dense"
USER_EMBEDDING = "user_embedding"
TEACHER_EMBEDDING = "teacher_embedding"

#: Columns only format 1 had: their presence names a data set to convert.
V1_COLUMNS = ("history_item_id", "history_action", "candidate_item_id")


def event_column(name: str) -> str:
    return f"event.{name}"


def candidate_column(name: str) -> str:
    return f"candidate.{name}"


def label_column(task: str) -> str:
    return f"label.{task}"


def teacher_logit_column(task: str) -> str:
    return f"teacher_logit.{task}"


def sparse_column(name: str) -> str:
    return f"sparse.{name}"


def _ids_type(feature: SequenceFeature) -> Any:
    import pyarrow as pa

    ids = pa.list_(pa.int64())
    return pa.list_(ids) if feature.multi_valued else ids


def arrow_schema(schema: FeatureSchema) -> Any:
    """The pyarrow schema every Parquet file of a data set with ``schema`` has, in this order."""
    import pyarrow as pa

    ids = pa.list_(pa.int64())
    floats = pa.list_(pa.float32())
    fields = [
        pa.field(USER_ID, pa.int64(), nullable=False),
        pa.field(REQUEST_TIMESTAMP, pa.int64(), nullable=False),
        pa.field(HISTORY_TIMESTAMP, ids, nullable=False),
    ]
    fields += [pa.field(event_column(f.name), _ids_type(f), nullable=False)
               for f in schema.event_features]
    if schema.seq_dense_dim:
        fields.append(pa.field(HISTORY_DENSE, floats, nullable=False))
    fields += [pa.field(candidate_column(f.name), _ids_type(f), nullable=False)
               for f in schema.candidate_features]
    fields += [pa.field(label_column(t), floats, nullable=False) for t in schema.tasks]
    if schema.candidate_content:
        fields.append(pa.field(CANDIDATE_DENSE, floats, nullable=False))
    if schema.candidate_numeric_dim:
        fields.append(pa.field(CANDIDATE_NUMERIC, floats, nullable=False))
    fields += [pa.field(sparse_column(f.name), ids, nullable=False) for f in schema.sparse_features]
    if schema.num_dense:
        fields.append(pa.field(DENSE, pa.list_(pa.float32(), schema.num_dense), nullable=False))
    if schema.user_embedding_dim:
        fields.append(pa.field(USER_EMBEDDING, pa.list_(pa.float32(), schema.user_embedding_dim),
                               nullable=False))
    fields += [pa.field(teacher_logit_column(t), floats, nullable=False)
               for t in schema.teacher_tasks]
    if schema.teacher_embedding_dim:
        fields.append(pa.field(TEACHER_EMBEDDING,
                               pa.list_(pa.float32(), schema.teacher_embedding_dim),
                               nullable=False))
    return pa.schema(fields)


def id_columns(schema: FeatureSchema) -> Iterator[tuple[str, str, Any]]:
    """``(column, kind, feature)`` of every categorical feature's column (``kind`` is ``event``,
    ``candidate`` or ``context``)."""
    for kind, feature in schema.id_features():
        if kind == "event":
            yield event_column(feature.name), kind, feature
        elif kind == "candidate":
            yield candidate_column(feature.name), kind, feature
        else:
            yield sparse_column(feature.name), kind, feature


def is_id_column(name: str) -> bool:
    """Whether a column holds raw ids (stored as int64, or uint64 read as int64)."""
    return name == USER_ID or name.startswith(("event.", "candidate.", "sparse."))


def leaf_type(arrow_type: Any) -> Any:
    """The primitive type inside (nested) lists."""
    import pyarrow as pa

    while pa.types.is_list(arrow_type) or pa.types.is_fixed_size_list(arrow_type):
        arrow_type = arrow_type.value_type
    return arrow_type


def with_leaf(arrow_type: Any, leaf: Any) -> Any:
    """``arrow_type`` with its primitive leaf replaced by ``leaf`` (same nesting)."""
    import pyarrow as pa

    if pa.types.is_list(arrow_type):
        return pa.list_(with_leaf(arrow_type.value_type, leaf))
    if pa.types.is_fixed_size_list(arrow_type):
        return pa.list_(with_leaf(arrow_type.value_type, leaf), arrow_type.list_size)
    return leaf
