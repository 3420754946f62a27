"""Jagged tensors: values of many variable-length rows stored back to back, plus offsets.

Row ``b`` is ``values[offsets[b]:offsets[b + 1]]``. Nothing is padded to the batch maximum; the
helpers here that do pad (``to_padded``) exist for references and tests only.
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor


def lengths_from_offsets(offsets: Tensor) -> Tensor:
    return offsets[1:] - offsets[:-1]


def offsets_from_lengths(lengths: Tensor) -> Tensor:
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.to(torch.int64), dim=0, out=offsets[1:])
    return offsets


def max_length(lengths: Tensor) -> int:
    """The largest of ``lengths`` (0 if empty): a Python int read back from the tensor, which
    callers use to size padded buffers. Under ``torch.export`` it is a size symbol instead, so
    exported programs keep dynamic lengths; there it is at least 2 (a bound, not the exact
    maximum: callers pad to it and mask), because AOTInductor's matmul lowering must know that a
    padded width is not 1."""
    if not lengths.numel():
        return 0
    if torch.compiler.is_compiling():
        longest = lengths.max().clamp(min=2).item()
        torch._check(longest >= 2)
        return longest
    return lengths.max().item()


def row_ids(offsets: Tensor) -> Tensor:
    """For every value, the index of its row: ``(total,)`` int64."""
    lengths = lengths_from_offsets(offsets)
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths)


def positions_in_row(offsets: Tensor) -> Tensor:
    """For every value, its position within its row (0 for the first): ``(total,)`` int64."""
    total = int(offsets[-1])
    return torch.arange(total, device=offsets.device) - offsets[:-1][row_ids(offsets)]


def gather_rows(offsets: Tensor, indices: Tensor) -> tuple[Tensor, Tensor]:
    """Offsets of the rows ``indices`` (in that order) and the value positions that form them."""
    lengths = lengths_from_offsets(offsets)[indices]
    new_offsets = offsets_from_lengths(lengths)
    shift = torch.repeat_interleave(offsets[:-1][indices] - new_offsets[:-1], lengths)
    value_index = torch.arange(int(new_offsets[-1]), device=offsets.device) + shift
    return new_offsets, value_index


def check_offsets(offsets: Tensor, total: int, what: str) -> None:
    """Raise ValueError naming ``what`` if ``offsets`` is not a valid offsets vector for ``total``.

    On an accelerator the value checks are one asynchronous device assertion instead: reading
    values back would stall the host on every call (nine syncs per attention call on a GPU
    before this), and the assertion still stops the run, with the same message, at the next sync.
    """
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"{what}: offsets must be 1-D with batch+1 entries, "
                         f"got {tuple(offsets.shape)}")
    if offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{what}: offsets must be int32 or int64, got {offsets.dtype}")
    if offsets.device.type != "cpu":
        valid = (offsets[0] == 0) & (offsets[-1] == total)
        if offsets.numel() > 1:
            valid = valid & (offsets[1:] >= offsets[:-1]).all()
        torch._assert_async(valid, f"{what}: offsets must start at 0, end at {total} (the "
                                   "number of values) and never decrease")
        return
    if int(offsets[0]) != 0:
        raise ValueError(f"{what}: offsets must start at 0, got {int(offsets[0])}")
    if int(offsets[-1]) != total:
        raise ValueError(f"{what}: offsets end at {int(offsets[-1])} but there are {total} values")
    if offsets.numel() > 1 and bool((offsets[1:] < offsets[:-1]).any()):
        row = int(torch.nonzero(offsets[1:] < offsets[:-1])[0])
        raise ValueError(f"{what}: offsets decrease at row {row}")


@attrs.frozen
class Jagged:
    """Variable-length rows of ids or vectors: ``values`` ``(total, ...)`` and ``offsets``
    ``(B+1,)``."""

    values: Tensor
    offsets: Tensor

    @property
    def batch_size(self) -> int:
        return self.offsets.numel() - 1

    def lengths(self) -> Tensor:
        return lengths_from_offsets(self.offsets)

    def select(self, indices: Tensor) -> Jagged:
        new_offsets, value_index = gather_rows(self.offsets, indices)
        return Jagged(self.values[value_index], new_offsets)

    def to(self, device: torch.device | str) -> Jagged:
        return Jagged(self.values.to(device), self.offsets.to(device))

    def to_padded(self, max_len: int | None = None, pad_value: float = 0) -> Tensor:
        """Dense ``(B, max_len, ...)`` copy, for references and tests only."""
        lengths = self.lengths()
        width = int(lengths.max()) if max_len is None and lengths.numel() else (max_len or 0)
        out = self.values.new_full((self.batch_size, width, *self.values.shape[1:]), pad_value)
        rows = row_ids(self.offsets)
        pos = positions_in_row(self.offsets)
        keep = pos < width
        out[rows[keep], pos[keep]] = self.values[keep]
        return out
