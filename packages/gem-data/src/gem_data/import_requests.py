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
    if "request_id" in log.columns:
        return ("request_id",)
    return (options.user_column, options.timestamp_column)


def key_name(columns: tuple[str, ...], values: list[Any]) -> str:
    """A request's key as a message names it: ``request 'r1'``, or ``request (user 5,
    time_stamp 1494000000)``."""
    if len(columns) == 1:
        return f"request {values[0]!r}"
    return f"request ({', '.join(f'{c} {v!r}' for c, v in zip(columns, values))})"


def mixed_request(request: str, role: str, first: Any, here: Any) -> str:
    """The message of a request whose impressions have different users or times."""
    return (f"{request} has impressions with different {role}s ({first!r} and {here!r}); one "
            "request is one user at one time")


def mixed_context(request: str, role: str, first: Any, first_row: str, here: Any,
                  differ: int) -> str:
    """The message of a request whose impressions have different bags of a context feature."""
    return (f"{request} has impressions with different values of {role} ({first} on "
            f"{first_row}, {here} here); a request's context is the same on all its impressions "
            f"(impressions that differ: {differ}); to keep one value per impression, declare it "
            "under [[candidate_features]] instead")


def mixed_dense(request: str, name: str, first: float, first_row: str, here: float) -> str:
    """The message of a request whose impressions have different values of a dense column."""
    return (f"{request} has impressions with different values of dense feature {name!r} "
            f"({first:g} on {first_row}, {here:g} here); a request's context is the same on all "
            "its impressions")


def same_id(path: Any, first: str, second: str, request_id: int) -> str:
    """The message of two request keys with one 64-bit id."""
    return (f"{path}: {first} and {second} have the same 64-bit request id {request_id}; give "
            "the log a request id column (import.request_column)")


def fold_ids(values: list[np.ndarray]) -> np.ndarray:
    """The 64-bit ids of keys given column by column (see the module doc)."""
    h = None
    for column in values:
        v = _as_numbers(column)
        h = _splitmix(v) if h is None else _splitmix(h ^ v)
    return np.zeros(0, dtype=np.int64) if h is None else h


def _as_numbers(values: np.ndarray) -> np.ndarray:
    """A key column's values as int64: integers as they are, texts by their string id."""
    from gem_data.import_strings import string_id

    if values.dtype.kind in "iu":
        return values.astype(np.int64)
    distinct, inverse = np.unique(values, return_inverse=True)
    return np.array([string_id(str(v)) for v in distinct], dtype=np.int64)[inverse]


def user_numbers(users: np.ndarray, where: str = "") -> np.ndarray:
    """The data set's ``user_id`` (GAUC's groups) of raw user keys: integer ids as they are
    (uint64 with their bits), a text by its ``hash`` string id
    (:func:`gem_data.import_strings.string_id`). Stable across imports and time windows (a rank
    within one import would give one user another number in the next window). Two texts with
    one number stop the import, naming both (2^-64 per pair)."""
    from gem_core.errors import GemDataError

    if users.dtype.kind in "iu":
        return users.astype(np.int64)
    distinct, inverse = np.unique(users, return_inverse=True)
    numbers = text_numbers(distinct)
    unique, counts = np.unique(numbers, return_counts=True)
    if unique.size != numbers.size:
        twice = np.flatnonzero(numbers == unique[np.flatnonzero(counts > 1)[0]])[:2]
        raise GemDataError(same_user_number(where, distinct[twice[0]], distinct[twice[1]],
                                            int(numbers[twice[0]])))
    return numbers[inverse.reshape(-1)]


def text_numbers(texts: np.ndarray) -> np.ndarray:
    """The ``hash`` string id of each text (no check for two texts with one id)."""
    from gem_data.import_strings import string_id

    return np.array([string_id(str(v)) for v in texts], dtype=np.int64)


def same_user_number(where: str, first: Any, second: Any, number: int) -> str:
    """The message of two text user ids with one user number."""
    return (f"{where}users {str(first)!r} and {str(second)!r} have the same 64-bit user number "
            f"{number} (the hash of their text); give the logs integer user ids")


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
        return key_name(self.columns, [v[row].item() for v in self.values])

    def ids(self, heads: np.ndarray) -> np.ndarray:
        """The 64-bit ids of the requests whose first impressions are ``heads``; stops the
        import if two keys have one id."""
        from gem_core.errors import GemDataError

        ids = fold_ids([column[heads] for column in self.values])
        distinct, first, counts = np.unique(ids, return_index=True, return_counts=True)
        if distinct.size != ids.size:
            twice = int(np.flatnonzero(counts > 1)[0])
            rows = heads[np.flatnonzero(ids == distinct[twice])[:2]]
            raise GemDataError(same_id(self.log.path, self.name(int(rows[0])),
                                       self.name(int(rows[1])), int(distinct[twice])))
        return ids


def read_keys(log: Log, options: Any) -> RequestKeys:
    """The :class:`RequestKeys` of the impression log (times by :meth:`Log.times`, other
    columns by :meth:`Log.keys`)."""
    columns = key_columns(options, log)
    values = [log.times(c, "request time") if c == options.timestamp_column
              else log.keys(c, key_role(c, options)) for c in columns]
    return RequestKeys(log, columns, values)


def key_role(column: str, options: Any) -> str:
    """What a key column other than the time is, as errors name it."""
    return "user" if column == options.user_column else "request id"


def same_bags(log: Log, name: str, role: str, bags: tuple[np.ndarray, np.ndarray],
              rows: np.ndarray, heads: np.ndarray, keys: Any) -> None:
    """Refuse a context feature whose bag of ids (compared as a set with counts) on impression
    ``rows[i]`` is not the one on its request's first impression ``heads[i]``."""
    offsets, values = bags
    lengths = np.diff(offsets)
    differs = lengths[rows] != lengths[heads]
    if not differs.any():
        owner = np.repeat(np.arange(lengths.size), lengths)
        ordered = values[np.lexsort((values, owner))]  # each bag's ids sorted: order is free

        def gather(which: np.ndarray) -> np.ndarray:
            starts = np.repeat(offsets[:-1][which], lengths[which])
            within = np.arange(starts.size) - np.repeat(np.cumsum(lengths[which]) -
                                                        lengths[which], lengths[which])
            return ordered[starts + within]

        unequal = gather(rows) != gather(heads)
        differs = np.zeros(rows.size, dtype=bool)
        differs[np.repeat(np.arange(rows.size), lengths[rows])[unequal]] = True
    bad = np.flatnonzero(differs)
    if bad.size:
        row, other = int(rows[bad[0]]), int(heads[bad[0]])
        bag = lambda r: values[offsets[r]:offsets[r + 1]].tolist()  # noqa: E731
        log.fail(row, name, mixed_context(keys.name(row), role, bag(other), log.row_name(other),
                                          bag(row), int(bad.size)))
