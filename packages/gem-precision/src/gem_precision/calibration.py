"""Measuring what FP8 does to each candidate linear layer on a few calibration batches."""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, Mapping, Sequence

import attrs
import torch
from torch import Tensor, nn

from gem_precision.float8 import to_float8

LossFn = Callable[[Mapping[str, Tensor], Any], Tensor]


@attrs.frozen(kw_only=True)
class LayerMeasure:
    """FP8 vs float32 for one layer, aggregated over the calibration batches."""

    output_error: float
    grad_input_error: float
    grad_weight_error: float
    loss_change: float
    rows_per_batch: float
    """Rows (tokens or samples) the layer saw per batch: its FLOPs scale with it."""


class _RelativeError:
    """Relative L2 error accumulated over batches: ||a - b|| / ||b|| on the concatenation."""

    def __init__(self) -> None:
        self.diff = self.ref = 0.0

    def add(self, low: Tensor, ref: Tensor) -> None:
        self.diff += float((low.float() - ref.float()).pow(2).sum())
        self.ref += float(ref.float().pow(2).sum())

    @property
    def value(self) -> float:
        return math.sqrt(self.diff / self.ref) if self.ref > 0 else math.sqrt(self.diff)


@contextlib.contextmanager
def _calibration_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode (dropout off: every difference is FP8's) and the parameters' gradients left as
    they were."""
    was_training = model.training
    grads = {p: p.grad for p in model.parameters()}
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
        for p, g in grads.items():
            p.grad = g


def _capture(model: nn.Module, layers: Mapping[str, nn.Linear], batches: Sequence[Any],
             loss_fn: LossFn) -> tuple[dict[str, list[dict[str, Tensor]]], float]:
    """Every layer's input and output gradient for each call, and the float32 mean loss."""
    calls: dict[str, list[dict[str, Tensor]]] = {name: [] for name in layers}

    def record(name: str):
        def hook(module: nn.Module, args: Any, output: Tensor) -> None:
            slot = {"x": args[0].detach()}
            calls[name].append(slot)
            # paired per call, so a layer used twice in one forward keeps its pairs right
            output.register_hook(lambda g: slot.__setitem__("g", g.detach()))
        return hook

    handles = [layer.register_forward_hook(record(name)) for name, layer in layers.items()]
    total = 0.0
    try:
        for batch in batches:
            loss = loss_fn(model(batch), batch)
            loss.backward()
            total += float(loss.detach())
    finally:
        for handle in handles:
            handle.remove()
    return calls, total / len(batches)


def _mean_loss(model: nn.Module, batches: Sequence[Any], loss_fn: LossFn) -> float:
    with torch.no_grad():
        return sum(float(loss_fn(model(b), b)) for b in batches) / len(batches)


@contextlib.contextmanager
def _swapped(model: nn.Module, name: str, replacement: nn.Module) -> Iterator[None]:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    original = getattr(parent, child)
    setattr(parent, child, replacement)
    try:
        yield
    finally:
        setattr(parent, child, original)


def measure_layers(model: nn.Module, layers: Mapping[str, nn.Linear], batches: Sequence[Any],
                   loss_fn: LossFn, float8_config: Any) -> dict[str, LayerMeasure | None]:
    """For every layer: FP8 output and gradient errors on the inputs and output gradients it
    saw in a float32 forward/backward, and the loss change with only it in FP8. None for a
    layer the batches never reached."""
    if not batches:
        raise ValueError("calibration needs at least one batch")
    with _calibration_mode(model):
        calls, ref_loss = _capture(model, layers, batches, loss_fn)
        measures: dict[str, LayerMeasure | None] = {}
        for name, layer in layers.items():
            if not calls[name] or any("g" not in c for c in calls[name]):
                measures[name] = None
                continue
            fp8 = to_float8(layer, float8_config)  # shares the layer's parameters
            out, dx, dw = _RelativeError(), _RelativeError(), _RelativeError()
            rows = 0
            for call in calls[name]:
                x, g = call["x"], call["g"]
                rows += x.numel() // layer.in_features
                x_ref = x.clone().requires_grad_(True)
                x_low = x.clone().requires_grad_(True)
                with torch.enable_grad():
                    y_ref, y_low = layer(x_ref), fp8(x_low)
                    gx_ref, gw_ref = torch.autograd.grad(y_ref, (x_ref, layer.weight), g)
                    gx_low, gw_low = torch.autograd.grad(y_low, (x_low, fp8.weight), g)
                out.add(y_low.detach(), y_ref.detach())
                dx.add(gx_low, gx_ref)
                dw.add(gw_low, gw_ref)
            with _swapped(model, name, fp8):
                low_loss = _mean_loss(model, batches, loss_fn)
            measures[name] = LayerMeasure(
                output_error=out.value, grad_input_error=dx.value, grad_weight_error=dw.value,
                loss_change=(low_loss - ref_loss) / abs(ref_loss) if ref_loss else low_loss,
                rows_per_batch=rows / len(batches))
    return measures
