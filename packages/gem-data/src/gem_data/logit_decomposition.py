"""How much of each known part of the click logit a trained model carries.

On a generated log the click logit is a sum of known parts (a user's effect, an ad's effect,
planted indicators). A model's eval logits regressed on those parts by least squares say, per
part, what share of it the model learnt (slope 1: all of it, 0: none, above 1: overstated) and
how much of the model's logit no part explains (the residual's standard deviation: what the
model adds that the generating process does not have, noise included). Two models at the same
NE can differ here: one that shrinks the user's effect to half, another that learns it whole but
adds noise; they need different fixes.
"""

from __future__ import annotations

import math

import attrs
import numpy as np


class DecompositionError(ValueError):
    """Logits and parts that cannot be decomposed (lengths, non-finite values, parts that are
    linear combinations of the others)."""


@attrs.frozen(kw_only=True)
class LogitDecomposition:
    """The least-squares fit ``logit ~ intercept + sum_k slope_k part_k``."""

    intercept: float
    """The fitted constant."""

    slopes: dict[str, float]
    """Per part (in the order given), its slope: the share of that part the logits carry."""

    residual_sd: float
    """Standard deviation of what the parts leave of the logits."""

    r_squared: float
    """Share of the logits' variance the parts explain (0 where the logits do not vary: there
    is nothing to explain)."""


def decompose_logits(logits: np.ndarray, parts: dict[str, np.ndarray]) -> LogitDecomposition:
    """Regress ``logits`` on an intercept and ``parts`` (each one value per row) in float64."""
    logits = np.asarray(logits, dtype=np.float64)
    if logits.ndim != 1 or logits.size == 0:
        raise DecompositionError(f"logits must be one value per row; got shape {logits.shape}")
    if not parts:
        raise DecompositionError("no parts to decompose the logits into")
    columns = []
    for name, values in parts.items():
        values = np.asarray(values, dtype=np.float64)
        if values.shape != logits.shape:
            raise DecompositionError(f"part {name!r} has shape {values.shape}, the logits "
                                     f"{logits.shape}")
        if not np.isfinite(values).all():
            row = int(np.flatnonzero(~np.isfinite(values))[0])
            raise DecompositionError(f"part {name!r} is {values[row]} at row {row}")
        columns.append(values)
    if not np.isfinite(logits).all():
        row = int(np.flatnonzero(~np.isfinite(logits))[0])
        raise DecompositionError(f"logit at row {row} is {logits[row]}")
    design = np.column_stack([np.ones(logits.size), *columns])
    rank = np.linalg.matrix_rank(design)
    if rank < design.shape[1]:
        raise DecompositionError(
            f"the parts {list(parts)} and an intercept are linearly dependent on these rows "
            f"(rank {rank} of {design.shape[1]}): a part is constant or a sum of others")
    weights, *_ = np.linalg.lstsq(design, logits, rcond=None)
    residual = logits - design @ weights
    variance = float(logits.var())
    return LogitDecomposition(
        intercept=float(weights[0]),
        slopes={name: float(w) for name, w in zip(parts, weights[1:])},
        residual_sd=float(math.sqrt(residual.var())),
        r_squared=1.0 - float(residual.var()) / variance if variance > 0 else 0.0)


def logits_of(probabilities: np.ndarray, eps: float = 1e-7) -> np.ndarray:
    """Log-odds of probabilities, clipped to ``[eps, 1 - eps]`` (a score of exactly 0 or 1
    would be an infinite logit)."""
    p = np.clip(np.asarray(probabilities, dtype=np.float64), eps, 1.0 - eps)
    return np.log(p) - np.log1p(-p)
