"""``fp8-auto``: FP8 only for the linear layers whose measured FP8 error is under the thresholds."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, ContextManager, Mapping, Sequence

from torch import nn

from gem_core.contracts import PrecisionRecipe
from gem_core.errors import GemConfigError
from gem_precision.activation_stash import ActivationStash
from gem_precision.calibration import LayerMeasure, LossFn, measure_layers
from gem_precision.float8 import emulate_on, float8_config
from gem_precision.fp8 import finish_conversion
from gem_precision.layer_table import LayerRow, LayerTable, sort_rows
from gem_precision.options import Fp8AutoOptions
from gem_precision.selection import fp8_candidates

log = logging.getLogger(__name__)


def decide(measure: LayerMeasure, options: Fp8AutoOptions) -> str:
    """Empty when the layer may run in FP8, else the first rule it fails."""
    grad_error = max(measure.grad_input_error, measure.grad_weight_error)
    if measure.output_error > options.max_output_error:
        return f"output error {measure.output_error:.4f} > {options.max_output_error:g}"
    if grad_error > options.max_grad_error:
        return f"grad error {grad_error:.4f} > {options.max_grad_error:g}"
    if abs(measure.loss_change) > options.max_loss_change:
        return f"loss change {measure.loss_change:+.5f} > {options.max_loss_change:g}"
    return "under every threshold"


def build_table(model: nn.Module, options: Fp8AutoOptions,
                measures: Mapping[str, LayerMeasure | None],
                skipped: Mapping[str, str]) -> LayerTable:
    shapes = {n: (m.in_features, m.out_features) for n, m in model.named_modules()
              if isinstance(m, nn.Linear)}
    flops = {n: 6.0 * shapes[n][0] * shapes[n][1] * m.rows_per_batch
             for n, m in measures.items() if m is not None}
    ranks = {n: i + 1 for i, n in enumerate(sorted(flops, key=lambda n: -flops[n]))}
    rows: list[LayerRow] = []
    for name, measure in measures.items():
        if measure is None:
            rows.append(LayerRow(name=name, shape=shapes[name], train_flops=0.0, benefit_rank=0,
                                 output_error=None, grad_input_error=None,
                                 grad_weight_error=None, loss_change=None, fp8=False,
                                 reason="not reached by the calibration batches"))
            continue
        reason = decide(measure, options)
        rows.append(LayerRow(
            name=name, shape=shapes[name], train_flops=flops[name], benefit_rank=ranks[name],
            output_error=measure.output_error, grad_input_error=measure.grad_input_error,
            grad_weight_error=measure.grad_weight_error, loss_change=measure.loss_change,
            fp8=reason == "under every threshold", reason=reason))
    rows += [LayerRow(name=name, shape=shapes[name], train_flops=0.0, benefit_rank=0,
                      output_error=None, grad_input_error=None, grad_weight_error=None,
                      loss_change=None, fp8=False, reason=reason)
             for name, reason in skipped.items()]
    thresholds = {"max_output_error": options.max_output_error,
                  "max_grad_error": options.max_grad_error,
                  "max_loss_change": options.max_loss_change}
    return LayerTable(recipe=options.recipe, thresholds=thresholds, rows=sort_rows(rows))


class Float8AutoRecipe(PrecisionRecipe):
    """Calibrates, then converts the layers the per-layer table chose (see ``LayerTable``)."""

    name = "fp8-auto"
    compute_dtype = "float8"
    calibration_batches = 4
    """Training batches the trainer hands to ``calibrate`` (enough for stable error estimates)."""

    def __init__(self) -> None:
        self.table: LayerTable | None = None
        self.measures: dict[str, LayerMeasure | None] = {}
        """Per-layer measurements of the last calibration (``build_table`` re-decides on them)."""
        self.skipped: dict[str, str] = {}
        self._options: Fp8AutoOptions | None = None
        self.converted: tuple[str, ...] = ()
        self.stash: ActivationStash | None = None

    def calibrate(self, model: nn.Module, batches: Sequence[Any], loss_fn: LossFn,
                  options: Fp8AutoOptions) -> LayerTable:
        """``options``: ``[precision.options]`` as ``Fp8AutoOptions`` (structured by gem-core)."""
        candidates, skipped = fp8_candidates(model, exclude=options.exclude,
                                             min_dim=options.min_dim)
        emulate = emulate_on(next(model.parameters()).device, options.float8_matmul)
        measures = measure_layers(model, candidates, batches, loss_fn,
                                  float8_config(options.recipe, emulate=emulate))
        self.measures, self.skipped = measures, skipped
        self.table = build_table(model, options, measures, skipped)
        self._options = options
        text = self.table.format()
        log.info("%s", text)
        print(text, flush=True)  # the decision is part of the run's output, not only its log
        if options.report_path:
            self.table.write(options.report_path)
        return self.table

    def convert(self, model: nn.Module, ctx: Any, options: Fp8AutoOptions) -> nn.Module:
        if self.table is None:
            raise GemConfigError("fp8-auto chooses its layers by calibration: call calibrate() "
                                 "before convert() (the trainer does)")
        if options != self._options:
            raise GemConfigError("fp8-auto: convert() got other options than calibrate()")
        return finish_conversion(model, self.table.chosen, options, options.recipe, ctx, self)

    def autocast(self, device_type: str) -> ContextManager[None]:
        return contextlib.nullcontext()  # unconverted layers stay float32, as in fp8-rowwise

    def mixed_precision_policy(self) -> None:
        return None
