"""The ``structure`` check: whether a row group's requests are well formed enough to read.

Nulls at any nesting level, an event (candidate) feature whose list length disagrees with the
request's history (candidate count), dense sequences not ``seq_dense_dim`` times that length, a
request with no candidates, and a multi-valued feature with an empty id list for some event or
candidate. It runs before the value checks, which then see only requests that pass it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from gem_core.schema import FeatureSchema
from gem_data import format as fmt
from gem_data.arrow_io import list_child, single_array
from gem_data.validation_checker import Checker
from gem_data.validation_columns import list_lengths, rows_mask


def check_structure(table: Any, schema: FeatureSchema, c: Checker) -> None:
    """Every structural fault of ``table``, in this order (under ``error`` the first raises):
    nulls column by column, then the history's lengths, then the candidates'."""
    _check_nulls(table, c)
    _check_history(table, schema, c)
    _check_candidates(table, schema, c)


def _check_nulls(table: Any, c: Checker) -> None:
    """A null anywhere in a column, down through its list levels."""
    for name in table.column_names:
        level, chain = single_array(table.column(name)), []
        while True:
            if level.null_count:
                positions = np.flatnonzero(np.asarray(level.is_null(), dtype=bool))
                c.reject("structure", rows_mask(positions, chain, c.n),
                         lambda row, name=name: f"feature {name!r} value null")
            if not (pa.types.is_list(level.type) or pa.types.is_fixed_size_list(level.type)):
                break
            level, offsets = list_child(level)
            chain.append(offsets)


def _same_length(c: Checker, name: str, lengths: np.ndarray, expected: np.ndarray, what: str,
                 width: int = 1) -> None:
    """Rows whose ``lengths`` are not ``width`` x ``expected`` (``what`` words the expected)."""
    bad = lengths != expected * width
    if bad.any():
        c.reject("structure", bad, lambda row: (
            f"feature {name!r} has {int(lengths[row])} values where {what} "
            f"{int(expected[row])}" + (f" needs {int(expected[row]) * width}"
                                       if width != 1 else "")))


def _non_empty(c: Checker, name: str, column: Any, kind: str) -> None:
    """Rows of a multi-valued ``kind`` (event, candidate) feature with an empty id list."""
    inner = list_child(list_child(single_array(column))[0])[1]
    empty = np.diff(inner) == 0
    if empty.any():
        outer = list_child(single_array(column))[1]
        rows = rows_mask(np.flatnonzero(empty), [outer], c.n)

        def describe(row: int) -> str:
            first = int(np.flatnonzero(empty[outer[row]:outer[row + 1]])[0])
            return (f"feature {name!r} has an empty id list for {kind} {first} of the row "
                    f"(a multi-valued {kind} feature needs at least one id per {kind})")
        c.reject("structure", rows, describe)


def _check_history(table: Any, schema: FeatureSchema, c: Checker) -> None:
    """Event features and ``history_dense`` agree with ``history_timestamp``'s lengths."""
    history = list_lengths(table.column(fmt.HISTORY_TIMESTAMP))
    hist_offsets = list_child(single_array(table.column(fmt.HISTORY_TIMESTAMP)))[1]
    for f in schema.event_features:
        name = fmt.event_column(f.name)
        column = table.column(name)
        offsets = list_child(single_array(column))[1]
        if not np.array_equal(offsets, hist_offsets):  # equal offsets: no lengths to compare
            _same_length(c, name, np.diff(offsets), history, f"{fmt.HISTORY_TIMESTAMP!r} has")
        if f.multi_valued:
            _non_empty(c, name, column, "event")
    if schema.seq_dense_dim:
        _same_length(c, fmt.HISTORY_DENSE, list_lengths(table.column(fmt.HISTORY_DENSE)),
                     history, f"{fmt.HISTORY_TIMESTAMP!r} length", schema.seq_dense_dim)


def _check_candidates(table: Any, schema: FeatureSchema, c: Checker) -> None:
    """At least one candidate a request; every candidate feature, label, ``candidate_dense``,
    ``candidate_numeric`` and teacher logit has the request's candidate count (the first
    candidate feature's)."""
    first = schema.candidate_features[0]
    first_name = fmt.candidate_column(first.name)
    first_offsets = list_child(single_array(table.column(first_name)))[1]
    counts = np.diff(first_offsets)
    none = counts == 0
    if none.any():
        c.reject("structure", none, lambda row: (
            f"the request has no candidates (feature {first_name!r} is an empty list; every "
            "request needs at least one)"))
    what = f"the request's candidate count ({first_name!r}) is"
    for f in schema.candidate_features:
        name = fmt.candidate_column(f.name)
        column = table.column(name)
        offsets = list_child(single_array(column))[1]
        if name != first_name and not np.array_equal(offsets, first_offsets):
            _same_length(c, name, np.diff(offsets), counts, what)
        if f.multi_valued:
            _non_empty(c, name, column, "candidate")
    for task in schema.tasks:
        name = fmt.label_column(task)
        offsets = list_child(single_array(table.column(name)))[1]
        if not np.array_equal(offsets, first_offsets):
            _same_length(c, name, np.diff(offsets), counts, what)
    if schema.candidate_content:
        _same_length(c, fmt.CANDIDATE_DENSE, list_lengths(table.column(fmt.CANDIDATE_DENSE)),
                     counts, what, schema.seq_dense_dim)
    if schema.candidate_numeric_dim:
        _same_length(c, fmt.CANDIDATE_NUMERIC,
                     list_lengths(table.column(fmt.CANDIDATE_NUMERIC)), counts, what,
                     schema.candidate_numeric_dim)
    for task in schema.teacher_tasks:  # gem distill-precompute: one teacher logit a candidate
        name = fmt.teacher_logit_column(task)
        _same_length(c, name, list_lengths(table.column(name)), counts, what)
