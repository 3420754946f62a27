"""Our NE and AUC against TorchRec's own metric functions on random data (TorchRec is the
reference formula of the field; gem-core does not import it, the test does)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gem_core.metrics import normalized_entropy, roc_auc

ne_module = pytest.importorskip("torchrec.metrics.ne")
auc_module = pytest.importorskip("torchrec.metrics.auc")

ETA = 1e-12


def torchrec_ne(logits: torch.Tensor, labels: torch.Tensor) -> float:
    predictions = torch.sigmoid(logits.double())
    labels = labels.double()
    weights = torch.ones_like(labels)
    ce = ne_module.compute_cross_entropy(labels, predictions, weights, ETA)
    return ne_module.compute_ne(ce.sum(), weights.sum(), (labels * weights).sum(),
                                ((1 - labels) * weights).sum(), ETA).item()


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 400), rate=st.floats(0.02, 0.98), shift=st.floats(-3, 3),
       seed=st.integers(0, 2**31 - 1))
def test_ne_matches_torchrec(n, rate, shift, seed):
    gen = torch.Generator().manual_seed(seed)
    labels = (torch.rand(n, generator=gen) < rate).double()
    if labels.min() == labels.max():
        labels[0] = 1 - labels[0]  # both classes present: NE is defined
    logits = torch.randn(n, generator=gen, dtype=torch.float64) * 2 + shift + labels
    ours = normalized_entropy(logits, labels)
    theirs = torchrec_ne(logits, labels)
    assert math.isclose(ours, theirs, rel_tol=1e-6), (ours, theirs)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 300), seed=st.integers(0, 2**31 - 1))
def test_auc_matches_torchrec(n, seed):
    gen = torch.Generator().manual_seed(seed)
    labels = (torch.rand(n, generator=gen) < 0.3).float()
    labels[0], labels[1] = 0.0, 1.0
    # Continuous scores: no ties, where every AUC definition agrees.
    scores = torch.rand(n, generator=gen, dtype=torch.float64) + 0.3 * labels.double()
    # TorchRec keeps one row per task: (tasks, samples).
    theirs = auc_module.compute_auc(1, [scores[None]], [labels[None].double()],
                                    [torch.ones(1, n, dtype=torch.float64)]).item()
    assert math.isclose(roc_auc(scores, labels), theirs, abs_tol=1e-5)
