"""Metrics and no-model references on a peer export (:mod:`gem_data.peer_export`): what
``tools/peers.py`` reports beside the peers' and this trainer's figures, every one computed
by ``gem_core.metrics`` on the export's eval impressions.

- :func:`peer_metrics`: NE, AUC and GAUC of predicted probabilities;
- :data:`REFERENCES`: scores without a model, each a floor a trained model must beat:
  each item's training positive rate (:func:`item_rate_reference`), and the user's and the
  item's offsets learnt in one pass as ``model.id_bias`` learns them
  (:func:`id_offsets_reference`).

The references read an export's ``<name>.train.inter`` and ``<name>.test.inter`` (``name``:
the export's, ``peers`` for the tool's) and check the eval labels against ``eval_keys.npz``'s.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from gem_core.config.model_schema import ModelConfig
from gem_core.errors import GemDataError
from gem_core.metrics import task_report
from gem_data.one_pass_offsets import one_pass_offsets, summed_offsets
from gem_data.peer_export import read_atomic

PROBABILITY_EPS = 1e-7
"""Predicted probabilities are clipped to ``[eps, 1 - eps]`` before they become logits for
``gem_core.metrics`` (RecBole's models output float32 probabilities)."""
ITEM_RATE_PRIOR = 5
"""Pseudo-impressions at the overall positive rate added to every item's count in the item-rate
reference (an item seen once is not scored 0 or 1)."""


def peer_metrics(probabilities: np.ndarray, labels: np.ndarray, users: np.ndarray,
                 keep: np.ndarray | None = None) -> dict[str, float]:
    """``gem_core.metrics.task_report`` of predicted probabilities (as logits), over the
    impressions ``keep`` (None: all)."""
    if probabilities.shape != labels.shape:
        raise GemDataError(f"{probabilities.size} predictions for {labels.size} eval "
                           "impressions")
    if keep is not None:
        probabilities, labels, users = probabilities[keep], labels[keep], users[keep]
    p = np.clip(probabilities.astype(np.float64), PROBABILITY_EPS, 1 - PROBABILITY_EPS)
    logits = torch.from_numpy(np.log(p) - np.log1p(-p))
    return task_report(logits, torch.from_numpy(labels.astype(np.float64)),
                       torch.from_numpy(users.astype(np.int64)))


def _columns(path: Path, ids: tuple[str, ...], task: str) -> tuple[list[np.ndarray], np.ndarray]:
    """The id columns ``ids`` (as integers) and the ``task`` column of an exported ``.inter``
    file, in the file's order."""
    header, rows = read_atomic(path)
    names = [field.split(":")[0] for field in header]
    where, label = [names.index(name) for name in ids], names.index(task)
    return ([np.asarray([int(row[i]) for row in rows], dtype=np.int64) for i in where],
            np.asarray([float(row[label]) for row in rows], dtype=np.float64))


def _item_and_label_columns(path: Path, task: str) -> tuple[np.ndarray, np.ndarray]:
    """The ``item_id`` and ``task`` columns of an exported ``.inter`` file."""
    (items,), labels = _columns(path, ("item_id",), task)
    return items, labels


def _check_eval_labels(directory: Path, task: str, labels: np.ndarray, keys: Any) -> None:
    if not np.array_equal(labels, keys[task].astype(np.float64)):
        raise GemDataError(f"{directory}: the eval file's {task} labels are not eval_keys.npz's")


def item_rate_reference(directory: Path, task: str, keys: Any, keep: np.ndarray | None = None,
                        *, name: str = "peers") -> dict[str, float]:
    """No model: every eval impression scored by its item's positive rate among the exported
    training impressions (with :data:`ITEM_RATE_PRIOR` pseudo-impressions at the overall
    rate; an item never trained on gets the overall rate). What an item's own effect is worth:
    within-user ranking (GAUC) on data where users mostly differ in which items they are shown
    is largely this, and a model that learns less than it has not learnt the items."""
    train_items, train_labels = _item_and_label_columns(
        directory / f"{name}.train.inter", task)
    eval_items, eval_labels = _item_and_label_columns(
        directory / f"{name}.test.inter", task)
    _check_eval_labels(directory, task, eval_labels, keys)
    known, index = np.unique(train_items, return_inverse=True)
    counts = np.bincount(index, minlength=known.size).astype(np.float64)
    positives = np.bincount(index, weights=train_labels, minlength=known.size)
    overall = float(train_labels.mean())
    where = np.searchsorted(known, eval_items).clip(max=known.size - 1)
    seen = known[where] == eval_items
    rate = np.where(seen, (positives[where] + ITEM_RATE_PRIOR * overall)
                    / (counts[where] + ITEM_RATE_PRIOR), overall)
    return peer_metrics(rate, keys[task], keys["user_ids"], keep)


def id_offsets_reference(directory: Path, task: str, keys: Any, keep: np.ndarray | None = None,
                         *, name: str = "peers") -> dict[str, float]:
    """No model: every eval impression scored by the log-odds of the training positive rate
    plus its user's and its item's offsets, learnt in one pass over the exported training
    impressions in their order, one impression at a time, as ``model.id_bias`` steps them at
    its defaults (``id_bias_step``, ``id_bias_rate``, ``id_bias_prior``;
    :mod:`gem_data.one_pass_offsets`). What the two ids alone teach in one pass: a model that
    trains one pass on the same impressions and ends above it has not learnt its users and
    items."""
    fields = attrs.fields(ModelConfig)
    columns = ("user_id", "item_id")
    train_ids, train_labels = _columns(directory / f"{name}.train.inter", columns, task)
    eval_ids, eval_labels = _columns(directory / f"{name}.test.inter", columns, task)
    _check_eval_labels(directory, task, eval_labels, keys)
    positive_rate = float(train_labels.mean())
    if not 0 < positive_rate < 1:
        raise GemDataError(f"{directory}: every training impression's {task} is "
                           f"{positive_rate:g}; offsets need both classes")
    base = math.log(positive_rate / (1 - positive_rate))
    offsets = one_pass_offsets(np.full(len(train_labels), base), train_ids, train_labels,
                               rate=fields.id_bias_rate.default, step=fields.id_bias_step.default,
                               prior=fields.id_bias_prior.default)
    logits = base + summed_offsets(offsets, eval_ids)
    return peer_metrics(1 / (1 + np.exp(-logits)), keys[task], keys["user_ids"], keep)


REFERENCES = {
    "item rate": (item_rate_reference, "no model: the item's training positive rate"),
    "user and item offsets": (id_offsets_reference,
                              "no model: each learnt in one pass as model.id_bias steps it"),
}
"""The no-model rows of the table: name -> (function, what the row is)."""


