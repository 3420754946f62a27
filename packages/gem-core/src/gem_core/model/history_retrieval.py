"""Retrieval from long histories: per candidate, the older events that share an attribute with it.

A learned attention over a history of thousands of events costs candidates x events; SIM and
TWIN first select, from the whole history, the events that share the candidate's category (a
hard search) and attend over those only. Here the search is exact on raw ids, for every
attribute a candidate shares with the events (see
:func:`gem_core.model.target_match.shared_attributes`): an event is retrieved for a
candidate when one of its ids equals the candidate's id of that attribute (for multi-valued
attributes, when the two lists have an id in common), optionally only events of an engaged
action. The most recent ``budget`` such events older than the recent window are kept, so a
purchase of the candidate's advertiser 200 page views ago reaches the candidate without scoring
the 200 views. The search compares ids only (no FLOPs); what follows it scores ``budget`` more
events per candidate.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from gem_core.batch import Ids
from gem_core.model.target_match import overlap


def retrieve_matching_events(offsets: Tensor, owner: Tensor, candidate_ids: Mapping[str, Ids],
                             event_ids: Mapping[str, Ids], pairs: list[tuple[str, str]], *,
                             budget: int, skip_recent: int,
                             engaged: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """For each candidate (``owner``: its request), the positions of up to ``budget`` events of
    its request that share an attribute with it, most recent first, among the events older than
    the last ``skip_recent``; ``engaged`` ``(E,)`` bool keeps only those events. Returns
    ``(N, budget)`` indices and a validity mask (fewer matches leave slots empty)."""
    candidates = owner.numel()
    lengths = (offsets[1:] - offsets[:-1])[owner]
    longest = int(lengths.max()) if candidates else 0
    index_out = torch.zeros(candidates, budget, dtype=torch.int64, device=offsets.device)
    valid_out = torch.zeros(candidates, budget, dtype=torch.bool, device=offsets.device)
    if longest <= skip_recent or budget == 0:
        return index_out, valid_out
    back = torch.arange(skip_recent, longest, device=offsets.device)  # 0: the most recent
    present = back.unsqueeze(0) < lengths.unsqueeze(1)  # (N, L)
    index = (offsets[1:][owner].unsqueeze(1) - 1 - back.unsqueeze(0)).clamp(min=0)
    match = torch.zeros_like(present)
    for candidate, event in pairs:
        match |= overlap(candidate_ids[candidate], event_ids[event], index, count=False) > 0
    match &= present
    if engaged is not None:
        match &= engaged[index]
    rank = torch.cumsum(match, dim=1) - 1  # among the candidate's matches, most recent first
    rows, columns = torch.nonzero(match & (rank < budget), as_tuple=True)
    slots = rank[rows, columns]
    index_out[rows, slots] = index[rows, columns]
    valid_out[rows, slots] = True
    return index_out, valid_out
