"""Backward launch settings of the Triton attention kernels, and the ones refused on a GPU.

Two settings gave wrong gradients on the H200 (docs/perf.md, "Two backward launch settings gave
wrong gradients", GPU run of 2026-11-29, raw results in docs/gpu/gpu_tune_2026-11-29.json) while
the same tiles agree with the default to 1e-7 in the interpreter. The cause (a miscompile or a
race in the compiled code) is not found yet, so they are refused by name wherever compiled
kernels would run; the interpreter still takes them (that is where they are checked to agree).
``python -m gem_kernels.bench.gpu_tune`` runs them on purpose, to keep measuring the fault.
"""

from __future__ import annotations

import attrs


def _tile(value: tuple[int, int]) -> tuple[int, int]:
    tile = tuple(int(x) for x in value)
    if len(tile) != 2 or any(x < 16 or x & (x - 1) for x in tile):
        raise ValueError(f"a tile is (query rows, key rows), powers of two >= 16, got {value}")
    return tile  # type: ignore[return-value]


@attrs.frozen(kw_only=True)
class BackwardLaunch:
    """How the two backward kernels are launched."""

    dkdv_blocks: tuple[int, int] = attrs.field(converter=_tile)
    """(query tile, key tile) of the dK/dV kernel (one program per key tile)."""

    dq_blocks: tuple[int, int] = attrs.field(converter=_tile)
    """(query tile, key tile) of the dQ kernel (one program per query tile)."""

    num_warps: int = 4
    """Warps per program."""

    num_stages: int | None = None
    """Software-pipelining depth; None: triton's default."""

    def describe(self) -> str:
        (km, kn), (qm, qn) = self.dkdv_blocks, self.dq_blocks
        stages = "default stages" if self.num_stages is None else f"{self.num_stages} stages"
        return (f"dK/dV tiles {km} x {kn} with dQ tiles {qm} x {qn} ({self.num_warps} warps, "
                f"{stages})")


WRONG_ON_CUDA: dict[BackwardLaunch, str] = {
    BackwardLaunch(dkdv_blocks=(32, 64), dq_blocks=(64, 32), num_warps=4, num_stages=3):
        "gradients 30 % of the largest gradient away from the default's on the H200",
    BackwardLaunch(dkdv_blocks=(32, 128), dq_blocks=(128, 32), num_warps=8, num_stages=2):
        "gradients 63 % of the largest gradient away from the default's on the H200",
}
"""Backward launch settings measured wrong on a GPU, with what was measured."""


def check_backward_launch(launch: BackwardLaunch, *, device_type: str, interpreted: bool,
                          allow_known_wrong: bool = False) -> None:
    """Raise ValueError, naming the setting and the finding, for a setting of
    :data:`WRONG_ON_CUDA` that would run compiled on CUDA (not in the interpreter, where the
    settings agree). ``allow_known_wrong``: for the tuning tool that measures the fault."""
    finding = WRONG_ON_CUDA.get(launch)
    if finding is None or allow_known_wrong or interpreted or device_type != "cuda":
        return
    raise ValueError(
        f"triton attention backward launch setting {launch.describe()} is refused on CUDA: "
        f"{finding} (docs/perf.md, 'Two backward launch settings gave wrong gradients'; the "
        "cause is not found). Use the default launch settings")
