"""One input log of ``gem data import`` (Parquet or CSV): reading it and converting its columns to
numpy, checked, with errors that name the file, the row (CSV: the line) and the column.

Ids stay exact 64-bit integers from every input, never through float64: a CSV's id and key
columns are read as text (Arrow would infer ``double`` for ids of 2^63 and more, rounding them)
and parsed as int64, or as uint64 kept with the same bits; Parquet integer columns and lists of
integers are taken as they are (uint64 with the same bits), and a null inside a list is an error
naming the row, not a value. Arrow timestamps become whole seconds, rounded down (sub-second
parts are dropped: see :meth:`Log.times`).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Iterable

import numpy as np

SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv"}
_UNITS = {"s": 1, "ms": 10**3, "us": 10**6, "ns": 10**9}


def file_kind(path: Path) -> str:
    """``parquet`` or ``csv`` by the file's suffix; a missing file or another suffix stops the
    import."""
    from gem_core.errors import GemDataError

    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise GemDataError(f"{path}: unknown file type {path.suffix!r}; use .parquet, .pq or "
                           ".csv")
    if not path.is_file():
        raise GemDataError(f"{path}: no such file")
    return kind


def check_names(path: Path, names: list[str], kind: str) -> None:
    """Refuse a column name that appears twice in a file's header (CSV) or schema (Parquet)."""
    from gem_core.errors import GemDataError

    repeated = [name for name, count in Counter(names).items() if count > 1]
    if repeated:
        name = repeated[0]
        places = [str(i + 1) for i, n in enumerate(names) if n == name]
        where = "header" if kind == "csv" else "schema"
        raise GemDataError(f"{path}: column {name!r} appears {len(places)} times in the {where} "
                           f"(columns {', '.join(places)}); every column needs a name of its own")


def csv_convert_options(text_columns: Iterable[str], types: dict[str, Any] | None = None) -> Any:
    """How a CSV log is converted: ``text_columns`` (ids and keys) as text, to be parsed exactly
    by :class:`Log`; empty cells (and NA, NULL, ...) of them are missing values, as they are in
    the columns Arrow types itself; ``types``: more columns of a given type."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    column_types = dict(types or {})
    column_types.update({name: pa.string() for name in text_columns})
    return pacsv.ConvertOptions(column_types=column_types, strings_can_be_null=True)


def read_table(path: Path, text_columns: Iterable[str] = ()) -> Any:
    """The table of a log file; in a CSV, ``text_columns`` (ids and keys) are read as text, to be
    parsed exactly by :class:`Log`."""
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    from gem_core.errors import GemDataError

    kind = file_kind(path)
    try:
        if kind == "parquet":
            table = pq.read_table(path)
        else:
            table = pacsv.read_csv(path, convert_options=csv_convert_options(text_columns))
    except Exception as error:  # pyarrow raises several types; all mean "cannot read"
        raise GemDataError(f"{path}: cannot read ({type(error).__name__}: {error})") from None
    check_names(path, table.column_names, kind)
    return table


def _is_text(arrow_type: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)


def _is_list(arrow_type: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)


def _integers(column: Any) -> np.ndarray:
    """An integer arrow column (no nulls) as int64; uint64 keeps its bits."""
    values = column.to_numpy()
    return values.view(np.int64) if values.dtype == np.uint64 else values.astype(np.int64)


class Cells:
    """A feature's column over the rows of one log: ``offsets`` (rows + 1; None for a
    single-valued feature) into ``values`` (int64 ids, or a pyarrow string array when
    ``text``), which rows are ``missing`` (no value: 0 or no ids there), and how many null ids
    were removed from inside lists."""

    def __init__(self, offsets: np.ndarray | None, values: Any, missing: np.ndarray,
                 null_ids: int, text: bool) -> None:
        self.offsets, self.values, self.missing = offsets, values, missing
        self.null_ids, self.text = null_ids, text


class KeyCells:
    """A key column (user, request, side-table key) over the rows: ``numbers`` (int64; uint64
    with the same bits) when every value is an integer, else None and ``texts`` (the values as
    text, a numpy array); which rows are ``missing``; and, for a text column read as numbers,
    whether some number is negative (``signed``) or needs uint64 (``unsigned``): a column
    read in blocks (:mod:`gem_data.import_blocks`) is numbers only if its blocks agree."""

    def __init__(self, numbers: np.ndarray | None, texts: Any, missing: np.ndarray, *,
                 from_text: bool, signed: bool = False, unsigned: bool = False) -> None:
        self.numbers, self.texts, self.missing = numbers, texts, missing
        self.from_text, self.signed, self.unsigned = from_text, signed, unsigned

    @property
    def values(self) -> np.ndarray:
        return self.numbers if self.numbers is not None else self.texts


class Log:
    """One input table with the helpers that convert its columns, naming file, row, column.

    ``first_row``: the table's first row in the file (a block of a log read in blocks);
    ``columns``: the file's columns (the table may hold only some of them)."""

    def __init__(self, path: Path, what: str, delimiter: str,
                 text_columns: Iterable[str] = (), *, table: Any = None, first_row: int = 0,
                 columns: list[str] | None = None) -> None:
        self.path, self.what, self.delimiter = path, what, delimiter
        self.table = read_table(path, text_columns) if table is None else table
        self.csv = SUFFIXES[path.suffix.lower()] == "csv"
        self.first_row = first_row
        self.columns = list(self.table.column_names if columns is None else columns)

    def row_name(self, row: int) -> str:
        # CSV: the file line (header is line 1); Parquet: the 0-based row.
        row += self.first_row
        return f"line {row + 2}" if self.csv else f"row {row}"

    def fail(self, row: int | None, column: str, message: str) -> None:
        from gem_core.errors import GemDataError

        where = f"{self.path}" + (f", {self.row_name(row)}" if row is not None else "")
        raise GemDataError(f"{where}, column {column!r}: {message}")

    def column(self, name: str, role: str, *, allow_missing: bool = False,
               hint: str = "") -> Any:
        """The column ``name``; a null in it stops the import (naming the first) unless
        ``allow_missing`` (``hint``: what to change to allow them)."""
        import pyarrow.compute as pc

        from gem_core.errors import GemDataError

        if name not in self.table.column_names:
            raise GemDataError(f"{self.path}: the {self.what} has no column {name!r} ({role}); "
                               f"its columns: {', '.join(self.columns)}")
        column = self.table.column(name)
        if allow_missing:
            return column
        nulls = pc.is_null(column)
        if pc.any(nulls).as_py():
            row = int(np.flatnonzero(nulls.to_numpy(zero_copy_only=False))[0])
            count = pc.sum(nulls).as_py()
            self.fail(row, name, f"missing value ({role}; {count} missing in the column){hint}")
        return column

    def keys(self, name: str, role: str) -> np.ndarray:
        """A key column (user, request) as a numpy array of ints or strings: text that is all
        64-bit integers gives the integers (uint64: the same bits)."""
        return self.key_cells(name, role)[0]

    def key_cells(self, name: str, role: str, *, allow_missing: bool = False
                  ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`keys` and, when ``allow_missing``, which rows have none (their key is 0 or
        the empty text)."""
        key = self.key_column(name, role, allow_missing=allow_missing)
        return key.values, key.missing

    def key_column(self, name: str, role: str, *, allow_missing: bool = False) -> KeyCells:
        """The :class:`KeyCells` of a key column: integers as they are (uint64: the same bits),
        text that is all 64-bit integers as the integers, other text as text."""
        import pyarrow as pa
        import pyarrow.compute as pc

        column = self.column(name, role, allow_missing=allow_missing)
        missing = np.asarray(pc.is_null(column).to_numpy(zero_copy_only=False), dtype=bool)
        if pa.types.is_integer(column.type):
            return KeyCells(_integers(pc.fill_null(column, 0)), None, missing, from_text=False)
        if _is_text(column.type):
            filled = pc.fill_null(column, "")
            texts = filled.to_numpy(zero_copy_only=False).astype(str)
            present = pc.filter(filled, pa.array(~missing)) if missing.any() else filled
            numbers, unsigned = self._cast_ids(present, with_target=True)
            if numbers is None:
                return KeyCells(None, texts, missing, from_text=True)
            signed = bool((numbers < 0).any()) and not unsigned
            if missing.any():
                numbers, some = np.zeros(missing.size, dtype=np.int64), numbers
                numbers[~missing] = some
            return KeyCells(numbers, texts, missing, from_text=True, signed=signed,
                            unsigned=unsigned)
        self.fail(None, name, f"{role} must be integers or strings, got {column.type}")
        raise AssertionError

    def times(self, name: str, role: str) -> np.ndarray:
        """Integer times as they are; Arrow timestamps as whole seconds since 1970, rounded
        down: an event and a request within one second then share a time and the event is left
        out of the history (never the other way round, so no later event can leak in)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        column = self.column(name, role)
        if pa.types.is_timestamp(column.type):
            ticks = pc.cast(column, pa.int64()).to_numpy()
            return np.floor_divide(ticks, _UNITS[column.type.unit])
        if not pa.types.is_integer(column.type):
            self.fail(None, name, f"{role} must be integers (seconds or any one unit) or "
                                  f"timestamps, got {column.type}")
        if pa.types.is_uint64(column.type):
            values = column.to_numpy()
            too_big = np.flatnonzero(values > np.iinfo(np.int64).max)
            if too_big.size:
                self.fail(int(too_big[0]), name, f"{role} {int(values[too_big[0]])} does not "
                                                 "fit in int64")
        return column.to_numpy().astype(np.int64)

    def ids(self, name: str, role: str) -> np.ndarray:
        """A single-valued id column as int64 (uint64: the same bits)."""
        return self.cells(name, role).values

    def cells(self, name: str, role: str, *, multi: bool = False, text: bool = False,
              allow_missing: bool = False, hint: str = "") -> Cells:
        """A feature's column over the rows: exact int64 ids or, with ``text``, the values as
        text (integers as their decimal digits) for :mod:`gem_data.import_strings` to map.
        Without ``allow_missing``, a null cell, an empty list and a null inside a list stop the
        import naming the row; with it they are :attr:`Cells.missing` rows (nulls inside a
        list are removed and counted, the list is missing if none is left)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        column = self.column(name, role, allow_missing=allow_missing, hint=hint)
        column = column.combine_chunks() if hasattr(column, "combine_chunks") else column
        missing = np.asarray(pc.is_null(column).to_numpy(zero_copy_only=False), dtype=bool)
        if not multi:
            if _is_list(column.type):
                self.fail(None, name, f"{role} is single-valued but the column holds lists; "
                                      "declare the feature multi_valued = true")
            if text:
                return Cells(None, self._texts(column, name, role), missing, 0, True)
            if pa.types.is_integer(column.type):
                return Cells(None, _integers(pc.fill_null(column, 0)), missing, 0, False)
            if _is_text(column.type):
                return Cells(None, self._parse_ids(pc.fill_null(column, "0"), None, name, role),
                             missing, 0, False)
            self._not_ids(name, role, column.type)
        if _is_text(column.type):
            column = pc.split_pattern(column, self.delimiter)
        if _is_list(column.type):
            lengths = np.asarray(pc.fill_null(pc.list_value_length(column), 0).to_numpy(
                zero_copy_only=False), dtype=np.int64)
            flat = pc.list_flatten(column)
        elif pa.types.is_integer(column.type):
            lengths = (~missing).astype(np.int64)
            flat = column.drop_null()
        else:
            self.fail(None, name, f"{role} is multi-valued: expected a list column (Parquet) "
                                  f"or {self.delimiter!r}-separated ids (CSV), got {column.type}")
            raise AssertionError
        empty = np.flatnonzero((lengths == 0) & ~missing)
        if empty.size and not allow_missing:
            self.fail(int(empty[0]), name, f"{role} is empty; every row needs at least one id "
                                           f"({empty.size} empty rows){hint}")
        owner = np.repeat(np.arange(lengths.size), lengths)
        null_ids = 0
        if flat.null_count:
            nulls = np.flatnonzero(pc.is_null(flat).to_numpy(zero_copy_only=False))
            if not allow_missing:
                row = int(owner[nulls[0]])
                start = int(np.searchsorted(owner, row))
                self.fail(row, name, f"{role}: id {int(nulls[0] - start) + 1} of the "
                                     f"{int(lengths[row])} in the list is null ({nulls.size} null "
                                     "ids in the column); remove the null or give the id")
            null_ids = int(nulls.size)
            lengths = lengths - np.bincount(owner[nulls], minlength=lengths.size)
            keep = np.ones(len(flat), dtype=bool)
            keep[nulls] = False
            owner = owner[keep]
            flat = pc.filter(flat, pa.array(keep))
        offsets = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        missing = missing | (lengths == 0)
        if text:
            values: Any = self._texts(flat, name, role)
        elif _is_text(flat.type):
            values = self._parse_ids(flat, owner, name, role,
                                     f" (ids separated by {self.delimiter!r})")
        elif pa.types.is_integer(flat.type):
            values = _integers(flat)
        else:
            self.fail(None, name, f"{role} must be lists of integer ids, got {column.type}")
            raise AssertionError
        return Cells(offsets, values, missing, null_ids, text)

    def _not_ids(self, name: str, role: str, arrow_type: Any) -> None:
        import pyarrow as pa

        hint = ""
        if pa.types.is_floating(arrow_type):
            hint = ("; ids are never read through floating point (2^53 + 1 would change): "
                    "write the column as integers (pandas makes an integer column with missing "
                    "values float: use its nullable \"Int64\" dtype)")
        self.fail(None, name, f"{role} must be integer ids, got {arrow_type}{hint}")

    def _texts(self, column: Any, name: str, role: str) -> Any:
        """A string array of the values as text: text trimmed of surrounding spaces, integers
        as decimal digits (uint64 unsigned), nulls kept."""
        import pyarrow as pa
        import pyarrow.compute as pc

        if _is_text(column.type):
            return pc.utf8_trim_whitespace(column).cast(pa.string())
        if pa.types.is_integer(column.type):
            return pc.cast(column, pa.string())
        self.fail(None, name, f"{role} must be text or integers, got {column.type}")
        raise AssertionError

    @staticmethod
    def _cast_ids(texts: Any, with_target: bool = False) -> Any:
        """Text ids as int64 exactly (as int64, else as uint64 with the same bits); None if some
        text is neither. ``with_target``: also whether uint64 was needed."""
        import pyarrow as pa
        import pyarrow.compute as pc

        trimmed = pc.utf8_trim_whitespace(texts)
        for target in (pa.int64(), pa.uint64()):
            try:
                values = pc.cast(trimmed, target).to_numpy()
            except pa.ArrowInvalid:
                continue
            unsigned = values.dtype == np.uint64
            values = values.view(np.int64) if unsigned else values
            return (values, unsigned) if with_target else values
        return (None, False) if with_target else None

    def _parse_ids(self, texts: Any, owner: np.ndarray | None, name: str, role: str,
                   hint: str = "") -> np.ndarray:
        """Text ids (no nulls) as int64, exactly; an id that is not an integer or does not fit
        64 bits names its row (``owner``: the row of each text, when they are a flattened
        multi-valued column)."""
        values = self._cast_ids(texts)
        if values is not None:
            return values
        # Some text is not a 64-bit integer, or the column mixes negative ids with ids of 2^63
        # and more: row by row, to name the row or convert each on its own.
        values = np.empty(len(texts), dtype=np.int64)
        for i, text in enumerate(texts.to_pylist()):
            row = i if owner is None else int(owner[i])
            try:
                number = int(text.strip())
            except ValueError:
                self.fail(row, name, f"{role}: {text!r} is not an integer id{hint}")
            if not -(1 << 63) <= number < (1 << 64):
                self.fail(row, name, f"{role}: {number} does not fit in 64 bits (ids are int64, "
                                     "or uint64 kept with the same bits)")
            values[i] = number - (1 << 64) if number >= (1 << 63) else number
        return values

    def multi_ids(self, name: str, role: str) -> tuple[np.ndarray, np.ndarray]:
        """A multi-valued id column: (offsets (rows + 1,), values), every row non-empty."""
        cells = self.cells(name, role, multi=True)
        return cells.offsets, cells.values

    def floats(self, name: str, role: str) -> np.ndarray:
        return self.float_cells(name, role)[0]

    def float_cells(self, name: str, role: str, *, allow_missing: bool = False, hint: str = ""
                    ) -> tuple[np.ndarray, np.ndarray]:
        """A numeric column as float64 and which rows are missing (0.0 there; only with
        ``allow_missing``, under which a NaN is missing too: how pandas and many writers store
        a missing number); any other value that is not finite stops the import."""
        import pyarrow as pa
        import pyarrow.compute as pc

        column = self.column(name, role, allow_missing=allow_missing, hint=hint)
        if not (pa.types.is_floating(column.type) or pa.types.is_integer(column.type)
                or pa.types.is_boolean(column.type)):
            self.fail(None, name, f"{role} must be numbers, got {column.type}")
        missing = np.asarray(pc.is_null(column).to_numpy(zero_copy_only=False), dtype=bool)
        if column.null_count:
            column = pc.fill_null(column, False if pa.types.is_boolean(column.type) else 0)
        values = column.to_numpy(zero_copy_only=False).astype(np.float64)
        if allow_missing:
            nan = np.isnan(values)
            missing = missing | nan
            values[nan] = 0.0
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            value = values[bad[0]]
            self.fail(int(bad[0]), name, f"{role} = {value} is not finite ({bad.size} such rows)"
                                         + (hint if np.isnan(value) else ""))
        return values, missing

    def check_floor(self, times: np.ndarray, name: str, role: str, floor: int) -> None:
        """Refuse a time before ``floor`` (``[import] time_floor``), naming its row."""
        from gem_data.validation_time import utc_date

        bad = np.flatnonzero(times < floor)
        if bad.size:
            value = int(times[bad[0]])
            self.fail(int(bad[0]), name, f"{role} {value} ({utc_date(value)}) is before "
                                         f"import.time_floor {floor} ({utc_date(floor)}; "
                                         f"{bad.size} such rows): a placeholder or corrupt time? "
                                         "Fix the rows, or lower time_floor in [import]")
