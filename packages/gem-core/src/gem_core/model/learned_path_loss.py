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
training only). The model reports its weighted binary cross-entropy *summed* over the rank's
impressions and tasks (``impression_loss_sums``); the trainer divides it by the global batch's
impressions as it does the task losses, so one rank and several train the same loss whatever
share of the batch each holds (``tests/test_distill.py`` compares a run on two ranks with one on
a single rank).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch.nn.functional as F
from torch import Tensor, nn

from gem_core.errors import GemConfigError


class LearnedPathLoss(nn.Module):
    """``weight * sum_t sum_n BCE(w_t . token_n + b_t, label_t,n)``: a logistic read of
    attribute attention's ``(N, d)`` token per task, summed over this rank's impressions."""

    def __init__(self, dim: int, tasks: Sequence[str], weight: float) -> None:
        super().__init__()
        if weight <= 0:
            raise GemConfigError(f"model.attribute_attention_loss must be > 0 to build its head; "
                                 f"got {weight}")
        self.tasks, self.weight = list(tasks), weight
        self.heads = nn.Linear(dim, len(self.tasks))

    def forward(self, token: Tensor, labels: Mapping[str, Tensor]) -> Tensor:
        logits = self.heads(token).float()
        return self.weight * sum(
            F.binary_cross_entropy_with_logits(logits[:, i], labels[task].float(),
                                               reduction="sum")
            for i, task in enumerate(self.tasks))
