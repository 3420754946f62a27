"""The value checks of well-formed requests: ``ids``, ``dense`` and ``labels``.

Each works on a column's flat values at once (:mod:`gem_data.validation_columns`): one test
over all of them, and only when some fail, the rows and the first bad value of each to name.
A repair (``clamp``) replaces the column in ``columns``; the caller rebuilds the table once
after every check has run.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gem_core.schema import FeatureSchema
from gem_data import format as fmt
from gem_data.validation_checker import Checker
from gem_data.validation_columns import leaf, owners, rebuild, rows_mask


def check_ids(columns: dict[str, Any], schema: FeatureSchema, c: Checker) -> bool:
    """Ids of ``dense``-policy tables outside ``[0, size)`` (``modulo`` and ``hash`` tables take
    any id). Whether a column was replaced (``clamp``)."""
    replaced = False
    for name, _kind, feature in fmt.id_columns(schema):
        table_spec = schema.table(feature.table)
        if table_spec.id_policy != "dense":
            continue
        size = table_spec.num_embeddings
        values, chain, shape = leaf(columns[name])
        # Fast path: two reductions and no temporaries when every id is in range (the norm).
        if values.size == 0 or (values.min() >= 0 and values.max() < size):
            continue
        bad_values = (values < 0) | (values >= size)
        positions = np.flatnonzero(bad_values)
        rows = rows_mask(positions, chain, c.n)
        if c.policy.ids == "clamp":
            c.repair("ids", rows)
            columns[name] = rebuild(columns[name], np.clip(values, 0, size - 1), chain, shape)
            replaced = True
            continue
        owner = owners(positions, chain)

        def describe(row: int, name=name, values=values, positions=positions, owner=owner,
                     size=size, table_name=table_spec.name) -> str:
            value = int(values[positions[np.flatnonzero(owner == row)[0]]])
            return (f"feature {name!r} value {value} is outside [0, {size}) of table "
                    f"{table_name!r} (id_policy 'dense')")
        c.reject("ids", rows, describe)
    return replaced


def _float_columns(schema: FeatureSchema) -> list[tuple[str, int]]:
    """Every float column with its width (0: the schema has none of it)."""
    return [(fmt.DENSE, schema.num_dense), (fmt.HISTORY_DENSE, schema.seq_dense_dim),
            (fmt.CANDIDATE_DENSE, schema.seq_dense_dim * schema.candidate_content),
            (fmt.CANDIDATE_NUMERIC, schema.candidate_numeric_dim),
            (fmt.USER_EMBEDDING, schema.user_embedding_dim),
            (fmt.TEACHER_EMBEDDING, schema.teacher_embedding_dim),
            *((fmt.teacher_logit_column(t), 1) for t in schema.teacher_tasks)]


def check_dense(columns: dict[str, Any], schema: FeatureSchema, c: Checker) -> bool:
    """NaN or infinite floats. Whether a column was replaced (``clamp``: by 0)."""
    replaced = False
    for name, width in _float_columns(schema):
        if not width:
            continue
        values, chain, shape = leaf(columns[name])
        bad_values = ~np.isfinite(values)
        if not bad_values.any():
            continue
        positions = np.flatnonzero(bad_values)
        rows = rows_mask(positions, chain, c.n)
        if c.policy.dense == "clamp":
            c.repair("dense", rows)
            columns[name] = rebuild(columns[name], np.where(bad_values, np.float32(0), values),
                                    chain, shape)
            replaced = True
            continue
        owner = owners(positions, chain)
        c.reject("dense", rows, lambda row, name=name, values=values, positions=positions,
                 owner=owner: (f"feature {name!r} value "
                               f"{float(values[positions[np.flatnonzero(owner == row)[0]]])} "
                               "is not finite"))
    return replaced


def check_labels(columns: dict[str, Any], schema: FeatureSchema, c: Checker) -> None:
    """Labels other than 0 or 1 (never repaired: no value would be right)."""
    for task in schema.tasks:
        name = fmt.label_column(task)
        values, chain, _ = leaf(columns[name])
        bad_values = ~((values == 0) | (values == 1))
        if bad_values.any():
            positions = np.flatnonzero(bad_values)
            owner = owners(positions, chain)
            c.reject("labels", rows_mask(positions, chain, c.n),
                     lambda row, name=name, values=values, positions=positions, owner=owner,
                     offsets=chain[0]: (
                         f"feature {name!r} value "
                         f"{float(values[positions[np.flatnonzero(owner == row)[0]]])} of "
                         "candidate "
                         f"{int(positions[np.flatnonzero(owner == row)[0]]) - int(offsets[row])}"
                         " is not 0 or 1"))
