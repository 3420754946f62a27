"""The learned path's own loss (``model.attribute_attention_loss``): attribute attention's
token, read alone by a logistic head per task, trained against the labels beside the model.

Where target match is on, its exact-match tokens explain at once the part of a label that
equality explains ("an engaged event of the candidate's category"), and attribute attention is
left the rest. What is left is what it cannot yet see: on ``hierarchy`` (the label pays for an
engaged event of a *sibling* category) the vectors it compares learn which categories are
siblings when target match is off (an AUC of 0.98 separating siblings from the rest by their
cosine) and not when it is on (0.47-0.51), although the same module and data are there
(docs/results.md). Equality is how it starts: a scorer that reads "same category" is what
passes the gradient that pulls siblings' vectors together.

This loss gives attribute attention a reason of its own to read equality: the head sees only
its token, so the token must carry whatever of the label the history's matches explain, exact
ones included; the model's prediction is unchanged (the head is not part of it, and it runs in
training only). Its weight scales a mean binary cross-entropy over the impressions, summed over
tasks, added to the training loss as the model's other auxiliary losses are: as theirs, the
mean is over this rank's impressions, so on several ranks (whose shares of a batch hold
different numbers of impressions) it is not the global batch's mean the task losses use, and a
run on two ranks does not repeat one on a single rank exactly (``tests/test_distill.py`` found
it). Normalising it like the task losses is what the presets wait for.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch.nn.functional as F
from torch import Tensor, nn


class LearnedPathLoss(nn.Module):
    """``weight * sum_t mean_n BCE(w_t . token_n + b_t, label_t,n)``: a logistic read of
    attribute attention's ``(N, d)`` token per task."""

    def __init__(self, dim: int, tasks: Sequence[str], weight: float) -> None:
        super().__init__()
        if weight <= 0:
            raise ValueError(f"model.attribute_attention_loss must be > 0 to build its head; "
                             f"got {weight}")
        self.tasks, self.weight = list(tasks), weight
        self.heads = nn.Linear(dim, len(self.tasks))

    def forward(self, token: Tensor, labels: Mapping[str, Tensor]) -> Tensor:
        logits = self.heads(token).float()
        return self.weight * sum(
            F.binary_cross_entropy_with_logits(logits[:, i], labels[task].float())
            for i, task in enumerate(self.tasks))
