"""Target match: what the user did with events that share an attribute with the candidate.

For every attribute a candidate shares with the history events (a candidate feature and an
event feature that index one declared table: ad id, advertiser, category, ...), the candidate
looks at the most recent ``window`` events of its request and sums a learned projection of the
events whose raw id equals its own. An event token carries its action, age and position, so the
sum says how often, how recently and how the user engaged with that advertiser or category.

Soft (dot-product) target attention can learn the same thing, but only after learning to make
``q.k`` of equal ids stand out among thousands of id embeddings; on data where the label turns
on "a clicked event among the last few has the candidate's advertiser" it was still far from
the achievable NE after thousands of steps. Exact matches of raw ids (before any hashing, so no
collision) need no learning to be found; what the match means is learned. Industrial rankers
feed the same signal as hand-made counting features ("ads of this advertiser clicked in the
last day"); here it is derived from the declared schema, for every shared table.

Single-valued features only: a multi-valued attribute (genres) has no single id to compare.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor, nn

from gem_core.batch import Ids
from gem_core.flops import linear_layer_flops
from gem_core.schema import FeatureSchema


def shared_attributes(schema: FeatureSchema) -> list[tuple[str, str]]:
    """``(candidate feature, event feature)`` pairs that index one table, single-valued both."""
    pairs = []
    for candidate in schema.candidate_features:
        for event in schema.event_features:
            if (candidate.table == event.table and not candidate.multi_valued
                    and not event.multi_valued):
                pairs.append((candidate.name, event.name))
    return pairs


def recent_event_index(offsets: Tensor, owner: Tensor, window: int) -> tuple[Tensor, Tensor]:
    """For each candidate (``owner``: its request), the positions of its request's last
    ``window`` events, most recent first: ``(N, window)`` indices and a validity mask (a
    shorter history leaves slots empty)."""
    ends = offsets[1:][owner]
    lengths = (offsets[1:] - offsets[:-1])[owner]
    back = torch.arange(window, device=offsets.device)
    valid = back.unsqueeze(0) < lengths.unsqueeze(1)
    index = (ends.unsqueeze(1) - 1 - back.unsqueeze(0)).clamp(min=0)
    return index, valid


class TargetMatch(nn.Module):
    """One token per candidate: per shared attribute, the sum of a learned projection of the
    recent events whose id equals the candidate's, summed over attributes."""

    def __init__(self, dim: int, pairs: list[tuple[str, str]], window: int) -> None:
        super().__init__()
        if not pairs:
            raise ValueError("model.target_match needs a candidate feature and an event feature "
                             "that share a table (single-valued); the schema has none")
        self.pairs, self.window = pairs, window
        self.values = nn.Linear(dim, dim * len(pairs), bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, history: Tensor, offsets: Tensor, owner: Tensor,
                candidate_ids: Mapping[str, Ids], event_ids: Mapping[str, Ids]) -> Tensor:
        """``history`` ``(E, d)`` event tokens; ``owner`` ``(N,)`` each candidate's request.
        Returns ``(N, d)``."""
        index, valid = recent_event_index(offsets, owner, self.window)
        dim = history.shape[1]
        if history.shape[0] == 0:
            return self.proj(history.new_zeros(owner.numel(), dim))
        values = self.values(history).view(-1, len(self.pairs), dim)[index]  # (N, W, P, d)
        matches = torch.stack([
            (event_ids[event][index] == candidate_ids[candidate].unsqueeze(1)) & valid
            for candidate, event in self.pairs], dim=2)  # (N, W, P)
        summed = (values * matches.unsqueeze(-1).to(values.dtype)).sum(dim=(1, 2))
        return self.proj(summed)

    def flops(self, events: int, candidates: int) -> int:
        """Forward FLOPs (matmuls): the value projection of every event, the output projection
        of every candidate."""
        return (linear_layer_flops(self.values, events)
                + linear_layer_flops(self.proj, candidates))
