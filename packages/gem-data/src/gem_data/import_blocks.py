"""A log of ``gem data import`` read in blocks of rows, for the engines that do not hold a whole
log in memory (:mod:`gem_data.import_stage`): each block is a :class:`~gem_data.import_log.Log`
of its rows, so every conversion and check of the numpy path runs on it as it is, and its errors
name the row in the file (``first_row``) and list the file's columns.

Parquet is read by row batches of the columns the import uses. A CSV is read by pyarrow's
streaming reader, with the types of the numpy path's reader, except that a streaming reader
takes a column's type from the first block: label and dense columns are read as float64 (the
numpy path converts them to float64; a ``true``/``false`` column stays boolean) and an integer
time column as int64, so a later block with a fractional number or a null there reads the same
as a whole file would. A later block whose values do not fit the first block's types otherwise
(a time column of integers, then a date) stops the import with pyarrow's message naming the
file, where the numpy path names the column's type.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Iterator

from gem_data.import_log import Log, check_names, csv_convert_options, file_kind

#: Rows per block of a Parquet log.
BLOCK_ROWS = 1 << 18

#: Bytes per block of a CSV log (pyarrow's streaming reader).
BLOCK_BYTES = 32 << 20


def _cannot_read(path: Path, error: Exception) -> Exception:
    from gem_core.errors import GemDataError

    return GemDataError(f"{path}: cannot read ({type(error).__name__}: {error})")


def read_blocks(path: Path, what: str, delimiter: str, text_columns: Iterable[str], *,
                wanted: Iterable[str], floats: Iterable[str] = (), times: Iterable[str] = (),
                block_rows: int = BLOCK_ROWS, block_bytes: int = BLOCK_BYTES) -> Iterator[Log]:
    """The blocks of the log at ``path``, each a :class:`Log` of its rows holding the columns
    of ``wanted`` the file has (CSV: ``text_columns`` as text, ``floats`` as numbers, ``times``
    as integers or timestamps). A file without rows gives no block."""
    kind = file_kind(path)
    wanted = list(dict.fromkeys(wanted))
    if kind == "parquet":
        yield from _parquet_blocks(path, what, delimiter, wanted, block_rows)
    else:
        yield from _csv_blocks(path, what, delimiter, list(text_columns), wanted, set(floats),
                               set(times), block_bytes)


def _parquet_blocks(path: Path, what: str, delimiter: str, wanted: list[str],
                    block_rows: int) -> Iterator[Log]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises several types; all mean "cannot read"
        raise _cannot_read(path, error) from None
    names = file.schema_arrow.names
    check_names(path, names, "parquet")
    # At least one column, so that a file lacking every wanted column still has blocks of its
    # rows (whose first check then names the missing column).
    columns = [name for name in names if name in wanted] or names[:1]
    first = 0
    batches = file.iter_batches(batch_size=block_rows, columns=columns)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as error:
            raise _cannot_read(path, error) from None
        if batch.num_rows:
            yield Log(path, what, delimiter, table=pa.Table.from_batches([batch]),
                      first_row=first, columns=names)
        first += batch.num_rows


def _csv_blocks(path: Path, what: str, delimiter: str, text_columns: list[str],
                wanted: list[str], floats: set[str], times: set[str],
                block_bytes: int) -> Iterator[Log]:
    import pyarrow as pa
    import pyarrow.csv as pacsv

    read = pacsv.ReadOptions(block_size=block_bytes)
    try:
        # The header and the types of the first block, as the numpy path's reader gives them.
        probe = pacsv.open_csv(path, read_options=read,
                               convert_options=csv_convert_options(text_columns))
        inferred = probe.schema
        probe.close()
    except Exception as error:
        raise _cannot_read(path, error) from None
    names = inferred.names
    check_names(path, names, "csv")
    present = [name for name in names if name in wanted] or names[:1]
    types: dict[str, Any] = {}
    for name in present:
        arrow_type = inferred.field(name).type
        numeric = pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type) \
            or pa.types.is_null(arrow_type)
        if name in floats and numeric:
            types[name] = pa.float64()
        elif name in times and (pa.types.is_integer(arrow_type) or pa.types.is_null(arrow_type)):
            types[name] = pa.int64()
    convert = csv_convert_options([c for c in text_columns if c in present], types)
    convert.include_columns = present
    try:
        reader = pacsv.open_csv(path, read_options=read, convert_options=convert)
    except Exception as error:
        raise _cannot_read(path, error) from None
    first = 0
    with reader:
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                return
            except Exception as error:
                raise _cannot_read(path, error) from None
            if batch.num_rows:
                yield Log(path, what, delimiter, table=pa.Table.from_batches([batch]),
                          first_row=first, columns=names)
            first += batch.num_rows
