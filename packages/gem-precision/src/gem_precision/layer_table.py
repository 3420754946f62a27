"""fp8-auto's per-layer table: what was measured for every linear layer and what was decided."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import attrs


@attrs.frozen(kw_only=True)
class LayerRow:
    """One linear layer of the model."""

    name: str
    """Module name (fqn)."""
    shape: tuple[int, int]
    """(in_features, out_features)."""
    train_flops: float
    """Training FLOPs per calibration batch (6 x in x out x rows): what FP8 would speed up."""
    benefit_rank: int
    """1 = largest FLOPs among the candidates; 0 for layers that were not candidates."""
    output_error: float | None
    """Relative L2 error of the FP8 output vs float32 (None: not a candidate)."""
    grad_input_error: float | None
    """Relative L2 error of the input gradient."""
    grad_weight_error: float | None
    """Relative L2 error of the weight gradient."""
    loss_change: float | None
    """Relative change of the calibration loss with only this layer in FP8."""
    fp8: bool
    """The decision."""
    reason: str
    """Why: the failed rule, or the reason it was no candidate."""


@attrs.frozen(kw_only=True)
class LayerTable:
    recipe: str
    thresholds: dict[str, float]
    rows: tuple[LayerRow, ...]

    @property
    def chosen(self) -> list[str]:
        return [r.name for r in self.rows if r.fp8]

    @property
    def fp8_flops_share(self) -> float:
        """Share of the candidates' linear FLOPs that run in FP8 (non-candidates are not
        measured, so they count as 0)."""
        total = sum(r.train_flops for r in self.rows)
        return sum(r.train_flops for r in self.rows if r.fp8) / total if total else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "thresholds": self.thresholds,
                "chosen": self.chosen, "fp8_flops_share": self.fp8_flops_share,
                "rows": [attrs.asdict(r) for r in self.rows]}

    def format(self) -> str:
        """A fixed-width text table, largest benefit first."""
        def num(value: float | None, spec: str) -> str:
            return "-" if value is None else format(value, spec)

        lines = [f"fp8-auto ({self.recipe} scaling; thresholds "
                 + ", ".join(f"{k}={v:g}" for k, v in self.thresholds.items())
                 + "; rank = expected benefit by layer FLOPs)",
                 f"{'rank':>4} {'layer':<32} {'shape':>9} {'MFLOP':>9} {'out_err':>8} "
                 f"{'dx_err':>8} {'dw_err':>8} {'loss_chg':>9} {'fp8':>4}  reason"]
        for r in self.rows:
            lines.append(
                f"{r.benefit_rank or '-':>4} {r.name:<32} {f'{r.shape[0]}x{r.shape[1]}':>9} "
                f"{r.train_flops / 1e6:>9.2f} {num(r.output_error, '.4f'):>8} "
                f"{num(r.grad_input_error, '.4f'):>8} {num(r.grad_weight_error, '.4f'):>8} "
                f"{num(r.loss_change, '+.5f'):>9} {'yes' if r.fp8 else 'no':>4}  {r.reason}")
        lines.append(f"chosen: {len(self.chosen)} layers, {self.fp8_flops_share:.1%} of the "
                     "candidates' linear FLOPs in FP8")
        return "\n".join(lines)

    def write(self, path: str | Path) -> None:
        """JSON at ``path`` and the text table next to it (``.txt``)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        path.with_suffix(".txt").write_text(self.format() + "\n")


def sort_rows(rows: Sequence[LayerRow]) -> tuple[LayerRow, ...]:
    """Candidates by benefit rank, then the non-candidates by name."""
    return tuple(sorted(rows, key=lambda r: (r.benefit_rank == 0, r.benefit_rank, r.name)))
