"""Which impressions form one request (``gem data import``), and the request's 64-bit id.

The key: ``[import] request_columns`` (several columns), else ``request_column``, else the
``request_id`` column if the impression log has one, else **the user and the timestamp**: a
request is then one user at one time (all impressions a user was shown at one timestamp).

The id: each key column's value as a 64-bit number ``v`` (an integer id as it is, uint64 with
its bits; a text by :func:`gem_data.import_strings.string_id`; a time in the import's unit),
folded with splitmix64's finalizer (:func:`gem_core.ids.splitmix64`): ``h = splitmix64(v1)``,
then ``h = splitmix64(h XOR v_i)`` for each further column. Stable across imports, machines and
file orders. Two different keys with one id would be one request to anything that keys by the
id, so the import checks that the map from keys to ids is one to one and stops naming both keys
if it is not (never seen in practice: 2^-64 per pair; a single integer column never collides,
the finalizer being a bijection).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gem_data.import_log import Log


def key_columns(options: Any, log: Log) -> tuple[str, ...]:
    """The impression-log columns keying a request (see the module doc)."""
    if options.request_columns:
        return tuple(options.request_columns)
    if options.request_column is not None:
        return (options.request_column,)
    if "request_id" in log.table.column_names:
        return ("request_id",)
    return (options.user_column, options.timestamp_column)


def _as_numbers(values: np.ndarray) -> np.ndarray:
    """A key column's values as int64: integers as they are, texts by their string id."""
    from gem_data.import_strings import string_id

    if values.dtype.kind in "iu":
        return values.astype(np.int64)
    distinct, inverse = np.unique(values, return_inverse=True)
    return np.array([string_id(str(v)) for v in distinct], dtype=np.int64)[inverse]


def _splitmix(values: np.ndarray) -> np.ndarray:
    import torch

    from gem_core.ids import splitmix64

    return splitmix64(torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))).numpy()


class RequestKeys:
    """The request key of every impression: ``code`` (0 .. requests - 1, by key), the key's
    columns and values, and the requests' 64-bit ids (:meth:`ids`)."""

    def __init__(self, log: Log, columns: tuple[str, ...], values: list[np.ndarray]) -> None:
        self.log, self.columns, self.values = log, columns, values
        code = np.zeros(log.table.num_rows, dtype=np.int64)
        for column in values:
            _, part = np.unique(column, return_inverse=True)
            _, code = np.unique(code * (int(part.max(initial=0)) + 1) + part,
                                return_inverse=True)
        self.code = code.reshape(-1)

    def name(self, row: int) -> str:
        """The key of impression ``row`` as a message names it: ``request 'r1'``, or
        ``request (user 5, time_stamp 1494000000)``."""
        if len(self.columns) == 1:
            return f"request {self.values[0][row].item()!r}"
        parts = ", ".join(f"{c} {v[row].item()!r}" for c, v in zip(self.columns, self.values))
        return f"request ({parts})"

    def ids(self, heads: np.ndarray) -> np.ndarray:
        """The 64-bit ids of the requests whose first impressions are ``heads``; stops the
        import if two keys have one id."""
        from gem_core.errors import GemDataError

        h = None
        for column in self.values:
            v = _as_numbers(column[heads])
            h = _splitmix(v) if h is None else _splitmix(h ^ v)
        ids = np.zeros(0, dtype=np.int64) if h is None else h
        distinct, first, counts = np.unique(ids, return_index=True, return_counts=True)
        if distinct.size != ids.size:
            twice = int(np.flatnonzero(counts > 1)[0])
            rows = heads[np.flatnonzero(ids == distinct[twice])[:2]]
            raise GemDataError(f"{self.log.path}: {self.name(int(rows[0]))} and "
                               f"{self.name(int(rows[1]))} have the same 64-bit request id "
                               f"{int(distinct[twice])}; give the log a request id column "
                               "(import.request_column)")
        return ids


def read_keys(log: Log, options: Any) -> RequestKeys:
    """The :class:`RequestKeys` of the impression log (times by :meth:`Log.times`, other
    columns by :meth:`Log.keys`)."""
    columns = key_columns(options, log)
    values = [log.times(c, "request time") if c == options.timestamp_column
              else log.keys(c, "user" if c == options.user_column else "request id")
              for c in columns]
    return RequestKeys(log, columns, values)
