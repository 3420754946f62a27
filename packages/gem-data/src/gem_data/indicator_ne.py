"""What a logistic regression on the planted indicators reaches: the NE to read next to
:func:`gem_data.generator.achievable_ne`.

The achievable NE is the floor of the generating process (its true probabilities); the
indicator regression is a simple model *handed* the kind's planted indicators
(:attr:`gem_data.generator.PlantedChunk.indicators`) instead of having to find them in the
history. A trained model's eval NE reads against both: near the regression's, it found the
planted pattern; well above it, it missed what the kind plants.
"""

from __future__ import annotations

import math

import numpy as np

from gem_data.generator import (
    EVAL_CHUNK_ROWS,
    TASKS,
    AdsLogGenerator,
    PlantedChunk,
    normalized_entropy_of_probabilities,
)

TRAIN_ROWS = 8192
"""Training requests the ``synthetic-ads`` source and ``gem data synth`` fit the regression on."""

INDICATOR_L2 = 1e-4
"""L2 penalty (on the mean log loss, every weight but the intercept) of the regressions."""


def indicator_regression_ne(generator: AdsLogGenerator, train_rows: int, eval_rows: int
                            ) -> dict[str, float]:
    """Per task, the eval NE of a logistic regression on the planted indicators: what a simple
    model handed the kind's indicators reaches, to read next to the achievable NE.

    Its inputs are the kind's planted history indicators (``PlantedChunk.indicators`` less
    the last column, the affinity) and an intercept: the hand-made matching features an
    engineer would add, as the issue's "logistic regression on the planted indicators". With
    the affinity and the request-level terms too it would be the generating process itself
    and reach the achievable NE (measured: within 0.001 of it on every kind), which says
    nothing a model can be compared with. It is fitted per task by Newton's method
    (float64, L2 penalty :data:`INDICATOR_L2` on the weights) on the candidates of
    ``train_rows`` training requests (training chunks ``0, 1, ...`` of ``EVAL_CHUNK_ROWS``
    requests: the training distribution, not necessarily the requests of a data set's row
    groups or of a source's batches), then evaluated on the eval split of ``eval_rows``
    requests, that of :func:`~gem_data.generator.achievable_ne`. The category drift
    (``drift_weight``) is not an input.
    """
    def design(chunks: list[PlantedChunk]) -> np.ndarray:
        x = np.concatenate([c.indicators[:, :-1] for c in chunks])
        return np.hstack([np.ones((x.shape[0], 1)), x])

    train = [generator.chunk_with_indicators(min(EVAL_CHUNK_ROWS, train_rows - start),
                                             split="train", index=index)
             for index, start in enumerate(range(0, train_rows, EVAL_CHUNK_ROWS))]
    evals = [generator.chunk_with_indicators(size, split="eval", index=index)
             for index, size in generator.eval_chunks(eval_rows)]
    if not train or not evals:
        return {}
    x_train, x_eval = design(train), design(evals)
    result = {}
    for task in TASKS:
        y = np.concatenate([c.batch.labels[task].numpy() for c in train]).astype(np.float64)
        weights = fit_logistic(x_train, y)
        labels = np.concatenate([c.batch.labels[task].numpy() for c in evals])
        result[task] = normalized_entropy_of_probabilities(sigmoid(x_eval @ weights), labels)
    return result


def fit_logistic(x: np.ndarray, y: np.ndarray, *, l2: float = INDICATOR_L2,
                 iterations: int = 50) -> np.ndarray:
    """Weights minimising the mean log loss of ``sigmoid(x @ w)`` against ``y`` plus
    ``l2 * |w[1:]|^2`` (column 0 of ``x`` is the intercept's), by damped Newton steps."""
    penalty = np.full(x.shape[1], 2.0 * l2)
    penalty[0] = 0.0

    def loss(w: np.ndarray) -> float:
        z = x @ w
        return float(np.mean(np.logaddexp(0.0, z) - y * z) + l2 * np.sum(w[1:] ** 2))

    w = np.zeros(x.shape[1])
    w[0] = math.log(max(y.mean(), 1e-6) / max(1.0 - y.mean(), 1e-6))
    current = loss(w)
    for _ in range(iterations):
        p = sigmoid(x @ w)
        gradient = x.T @ (p - y) / y.size + penalty * w
        hessian = (x * (p * (1.0 - p))[:, None]).T @ x / y.size + np.diag(penalty + 1e-9)
        step = np.linalg.solve(hessian, gradient)
        scale, trial = 1.0, loss(w - step)
        while trial > current and scale > 1e-4:  # halve the step until the loss falls
            scale /= 2.0
            trial = loss(w - scale * step)
        if trial > current:
            break
        w, previous, current = w - scale * step, current, trial
        if previous - current < 1e-12:
            break
    return w


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # no overflow for large |x|
