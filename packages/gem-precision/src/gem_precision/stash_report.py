"""Saved-activation bytes with and without the FP8 stash, on one batch of a model."""

from __future__ import annotations

import copy
from typing import Any, Callable, Mapping, Sequence

import attrs
from torch import Tensor, nn

from gem_precision.activation_stash import ActivationStash, count_saved_bytes, install_stash
from gem_precision.options import Fp8Options


@attrs.frozen(kw_only=True)
class StashReport:
    bytes_without: int
    """Distinct non-parameter tensors saved for backward, plain."""
    bytes_with: int
    """The same with the stash: what it stored (FP8 + scales), kept, and saved outside it."""
    quantized_tensors: int
    grad_rel_diffs: Mapping[str, float]
    """Relative L2 difference of each parameter's gradient, stash vs plain (non-zero ones)."""
    grad_rel_diff: float
    """Relative L2 difference of all gradients together (one vector), stash vs plain."""

    @property
    def max_grad_rel_diff(self) -> float:
        """Largest per-parameter relative difference."""
        return max(self.grad_rel_diffs.values(), default=0.0)

    @property
    def saved_fraction(self) -> float:
        return 1.0 - self.bytes_with / self.bytes_without if self.bytes_without else 0.0


def _saved_bytes_and_grads(model: nn.Module, batch: Any, loss_fn: Callable,
                           stash: ActivationStash | None) -> tuple[int, dict[str, Tensor]]:
    hooks, counted = count_saved_bytes()
    with hooks:
        loss = loss_fn(model(batch), batch)
    loss.backward()
    total = counted["bytes"]
    if stash is not None:  # what the stash holds never reached the outer counting hooks
        total += stash.stats.stored_bytes + stash.stats.kept_bytes
    return total, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def compare_saved_bytes(model: nn.Module, batch: Any,
                        loss_fn: Callable[[Mapping[str, Tensor], Any], Tensor], *,
                        scaling: str = "row", kinds: Sequence[str] | None = None,
                        min_numel: int = 1024) -> StashReport:
    """One forward and backward of two copies of ``model`` (``model`` is left untouched)."""
    kinds = Fp8Options().activation_modules if kinds is None else tuple(kinds)
    plain, stashed = copy.deepcopy(model), copy.deepcopy(model)
    stash = ActivationStash(scaling, min_numel)
    install_stash(stashed, stash, kinds)
    without, ref = _saved_bytes_and_grads(plain, batch, loss_fn, None)
    with_, low = _saved_bytes_and_grads(stashed, batch, loss_fn, stash)
    diffs = {n: float((low[n] - g).norm() / g.norm()) for n, g in ref.items() if g.norm() > 0}
    squared = sum(float((low[n] - g).square().sum()) for n, g in ref.items())
    total = sum(float(g.square().sum()) for g in ref.values())
    return StashReport(bytes_without=without, bytes_with=with_,
                       quantized_tensors=stash.stats.quantized_tensors, grad_rel_diffs=diffs,
                       grad_rel_diff=(squared / total) ** 0.5 if total else 0.0)
