"""How the validator reads a column: its primitive values and the offsets from rows down to them.

Every check works on a column's flat values (one vectorised test over all of them, never a loop
per row) and then needs the rows those values belong to, to drop or name them; a repair writes
new values back under the same offsets. These helpers are that round trip, for scalar, list,
fixed-size list and list-of-list columns alike.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from gem_data import format as fmt
from gem_data.arrow_io import list_child, list_parts, nested_list_parts, scalar_parts, single_array


def leaf(column: Any) -> tuple[np.ndarray, list[np.ndarray], str]:
    """``(values, chain, kind)``: the column's primitive values and the offsets from rows down
    to them (``[]`` scalar, ``[offsets]`` list or fixed-size list, ``[outer, inner]`` nested)."""
    typ = column.type
    if pa.types.is_list(typ) and pa.types.is_list(typ.value_type):
        values, inner, outer = nested_list_parts(column)
        return values, [outer, inner], "nested"
    if pa.types.is_list(typ) or pa.types.is_fixed_size_list(typ):
        values, offsets = list_parts(column)
        return values, [offsets], "fixed" if pa.types.is_fixed_size_list(typ) else "list"
    return scalar_parts(column), [], "scalar"


def owners(positions: np.ndarray, chain: list[np.ndarray]) -> np.ndarray:
    """The row of each value position, through the offsets chain."""
    for offsets in reversed(chain):
        positions = np.searchsorted(offsets, positions, side="right") - 1
    return positions


def rows_mask(positions: np.ndarray, chain: list[np.ndarray], n: int) -> np.ndarray:
    """Over ``n`` rows, those holding any of the value ``positions``."""
    mask = np.zeros(n, dtype=bool)
    mask[owners(positions, chain)] = True
    return mask


def rebuild(column: Any, values: np.ndarray, chain: list[np.ndarray], kind: str) -> Any:
    """A column of the same type and offsets as ``column`` with new primitive ``values``."""
    leaf_type = fmt.leaf_type(column.type)
    array = pa.array(values, type=leaf_type)
    if kind == "scalar":
        return array
    if kind == "fixed":
        return pa.FixedSizeListArray.from_arrays(array, column.type.list_size)
    if kind == "nested":
        inner = pa.ListArray.from_arrays(pa.array(chain[1].astype(np.int32)), array)
        return pa.ListArray.from_arrays(pa.array(chain[0].astype(np.int32)), inner)
    return pa.ListArray.from_arrays(pa.array(chain[0].astype(np.int32)), array)


def list_lengths(column: Any) -> np.ndarray:
    """The length of each row's list."""
    return np.diff(list_child(single_array(column))[1])
