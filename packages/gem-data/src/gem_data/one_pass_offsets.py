"""Per-id click-logit offsets learnt in one pass, without a model: the reference for what ids
alone teach a model that sees each training impression once.

Each training impression, in the given order, moves every id column's offset of its id by the
step ``model.id_bias_step`` names (:mod:`gem_core.train.table_optimizer` steps the model's
offsets the same way, a batch at a time):

- ``constant``: ``b += rate * (y - p)``;
- ``fisher``: ``b += (y - p) / (1 / rate + F)``, ``F`` the id's summed ``(y - p)^2`` including
  this impression's (a per-id Newton step under a Gaussian prior of variance ``rate``),

with ``p = sigmoid(base + sum of the impression's offsets as they stand)``. An id never trained
on keeps 0. With a ``learned`` prior (``model.id_bias_prior``), ``rate`` is where each column's
prior variance starts, and every ``every`` rows (a training step's impressions) it becomes the
mean over the column's ids seen so far of ``b^2 + 1 / (1 / prior + F)``.

Used by ``tools/taobao_shaped.py measure`` (on top of a regression on the planted indicators) and
``tools/peers.py`` (the user's and the item's offsets on the peers' very impressions).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

STEPS = ("fisher", "constant")
PRIORS = ("fixed", "learned")


def one_pass_offsets(base: np.ndarray, ids: Sequence[np.ndarray], labels: np.ndarray, *,
                     rate: float, step: str = "fisher", prior: str = "fixed",
                     every: int = 256) -> list[dict[float, float]]:
    """Each id column's offsets (``{id: offset}``) after one pass over the rows in order;
    ``base`` is each row's logit without them."""
    if step not in STEPS:
        raise ValueError(f"one_pass_offsets: step {step!r} is not one of {STEPS}")
    if prior not in PRIORS or (prior == "learned" and step != "fisher"):
        raise ValueError(f"one_pass_offsets: prior {prior!r} with step {step!r}: a prior is "
                         f"one of {PRIORS}, and a learned one needs the fisher step")
    if every < 1:
        raise ValueError(f"one_pass_offsets: every must be at least 1, got {every}")
    if rate <= 0:
        raise ValueError(f"one_pass_offsets: rate must be positive, got {rate}")
    rows = len(labels)
    if len(base) != rows or any(len(column) != rows for column in ids):
        raise ValueError(f"one_pass_offsets: {rows} labels, {len(base)} base logits and id "
                         f"columns of {[len(column) for column in ids]} rows")
    offsets: list[dict[float, float]] = [{} for _ in ids]
    information: list[dict[float, float]] = [{} for _ in ids]
    priors = [float(rate)] * len(ids)
    columns = [column.tolist() for column in ids]
    for row, (logit, label) in enumerate(zip(np.asarray(base).tolist(), labels.tolist())):
        keys = [column[row] for column in columns]
        total = logit + sum(table.get(key, 0.0) for table, key in zip(offsets, keys))
        residual = label - 1.0 / (1.0 + math.exp(-total))
        for index, (table, seen, key) in enumerate(zip(offsets, information, keys)):
            if step == "fisher":
                seen[key] = seen.get(key, 0.0) + residual * residual
                table[key] = table.get(key, 0.0) + residual / (1.0 / priors[index] + seen[key])
            else:
                table[key] = table.get(key, 0.0) + rate * residual
        if prior == "learned" and (row + 1) % every == 0:
            for index, (table, seen) in enumerate(zip(offsets, information)):
                means = np.fromiter(table.values(), dtype=np.float64, count=len(table))
                summed = np.fromiter(seen.values(), dtype=np.float64, count=len(seen))
                priors[index] = float(np.mean(means * means
                                              + 1.0 / (1.0 / priors[index] + summed)))
    return offsets


def summed_offsets(offsets: Sequence[dict[float, float]], ids: Sequence[np.ndarray]
                   ) -> np.ndarray:
    """Each row's sum of its ids' offsets (0 for an id the pass never saw)."""
    if len(offsets) != len(ids):
        raise ValueError(f"summed_offsets: {len(offsets)} offset tables, {len(ids)} id columns")
    total = np.zeros(len(ids[0]) if ids else 0)
    for table, column in zip(offsets, ids):
        total += np.array([table.get(key, 0.0) for key in column.tolist()])
    return total
