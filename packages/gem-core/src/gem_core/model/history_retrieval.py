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
from gem_core.config import ModelConfig
from gem_core.model.target_match import overlap


def retrieve_matching_events(offsets: Tensor, owner: Tensor, candidate_ids: Mapping[str, Ids],
                             event_ids: Mapping[str, Ids], pairs: list[tuple[str, str]], *,
                             budget: int, skip_recent: int, max_len: int,
                             engaged: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """For each candidate (``owner``: its request), the positions of up to ``budget`` events of
    its request that share an attribute with it, most recent first, among the events older than
    the last ``skip_recent``; ``engaged`` ``(E,)`` bool keeps only those events. ``max_len`` is
    at least every request's history length (:func:`gem_core.jagged.max_length`: a size symbol
    under ``torch.export``, so nothing here branches on the data). Returns ``(N, budget)``
    indices and a validity mask (fewer matches leave slots empty)."""
    candidates = owner.numel()
    if budget == 0:
        return (torch.zeros(candidates, 0, dtype=torch.int64, device=offsets.device),
                torch.zeros(candidates, 0, dtype=torch.bool, device=offsets.device))
    lengths = (offsets[1:] - offsets[:-1])[owner]
    back = torch.arange(max_len, device=offsets.device)  # 0: the most recent
    present = (back.unsqueeze(0) < lengths.unsqueeze(1)) & (back >= skip_recent)  # (N, L)
    index = (offsets[1:][owner].unsqueeze(1) - 1 - back.unsqueeze(0)).clamp(min=0)
    match = torch.zeros_like(present)
    for candidate, event in pairs:
        match |= overlap(candidate_ids[candidate], event_ids[event], index, count=False) > 0
    match &= present
    if engaged is not None:
        match &= engaged[index]
    rank = torch.cumsum(match, dim=1) - 1  # among the candidate's matches, most recent first
    # Each kept match goes to its rank's slot; the others to a spare slot past the budget,
    # dropped after (a scatter of fixed shape, not a nonzero of the data's size).
    slot = torch.where(match & (rank < budget), rank, budget)
    index_out = torch.zeros(candidates, budget + 1, dtype=torch.int64, device=offsets.device)
    valid_out = torch.zeros(candidates, budget + 1, dtype=torch.bool, device=offsets.device)
    index_out.scatter_(1, slot, index)
    valid_out.scatter_(1, slot, torch.ones_like(match))
    return index_out[:, :budget], valid_out[:, :budget]


def engaged_events(config: ModelConfig, event_ids: Mapping[str, Ids]) -> Tensor | None:
    """``(E,)`` whether each event is engaged (its action is not the view action), for
    ``model.attribute_attention_retrieve_engaged``; None when that is off."""
    if not config.attribute_attention_retrieve_engaged:
        return None
    return event_ids[config.action_feature] != config.view_action
