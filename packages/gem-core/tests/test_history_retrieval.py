"""Retrieval of older events that share an attribute with the candidate, against a loop."""

from __future__ import annotations

import pytest
import torch

from gem_core.jagged import Jagged
from gem_core.model.history_retrieval import retrieve_matching_events

BIG = 2**62 + 3  # raw 64-bit ids: exact comparisons only


def _oracle(offsets, owner, candidate_lists, event_lists, pairs, budget, skip_recent, engaged):
    out = []
    for n in range(owner.numel()):
        request = int(owner[n])
        start, end = int(offsets[request]), int(offsets[request + 1])
        found = []
        for e in range(end - 1 - skip_recent, start - 1, -1):  # most recent first
            if engaged is not None and not engaged[e]:
                continue
            if any(set(candidate_lists[c][n]) & set(event_lists[v][e]) for c, v in pairs):
                found.append(e)
        out.append(found[:budget])
    return out


def _as_ids(lists, multi):
    if not multi:
        return torch.tensor([values[0] for values in lists], dtype=torch.int64)
    lengths = torch.tensor([len(values) for values in lists])
    return Jagged(torch.tensor([v for values in lists for v in values], dtype=torch.int64),
                  torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]))


@pytest.mark.parametrize("with_engaged", [False, True])
def test_retrieval_matches_a_loop(with_engaged):
    generator = torch.Generator().manual_seed(0)
    lengths, candidates = [30, 0, 3, 45], [2, 1, 3, 4]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    owner = torch.repeat_interleave(torch.arange(4), torch.tensor(candidates))
    events, n = int(offsets[-1]), owner.numel()

    def draw(rows, multi, vocabulary):
        sizes = torch.randint(1, 4, (rows,), generator=generator) if multi else [1] * rows
        return [[BIG - int(v) for v in torch.randint(0, vocabulary, (int(s),),
                                                     generator=generator)] for s in sizes]

    event_lists = {"advertiser": draw(events, False, 6), "topics": draw(events, True, 9)}
    candidate_lists = {"advertiser": draw(n, False, 6), "topics": draw(n, True, 9)}
    pairs = [("advertiser", "advertiser"), ("topics", "topics")]
    engaged = torch.rand(events, generator=generator) < 0.3 if with_engaged else None
    index, valid = retrieve_matching_events(
        offsets, owner, {k: _as_ids(v, k == "topics") for k, v in candidate_lists.items()},
        {k: _as_ids(v, k == "topics") for k, v in event_lists.items()}, pairs,
        budget=5, skip_recent=4, max_len=max(lengths), engaged=engaged)
    want = _oracle(offsets, owner, candidate_lists, event_lists, pairs, 5, 4, engaged)
    assert [index[row][valid[row]].tolist() for row in range(n)] == want
    # max_len is a bound (as under torch.export), not the exact longest history: the same.
    bounded = retrieve_matching_events(
        offsets, owner, {k: _as_ids(v, k == "topics") for k, v in candidate_lists.items()},
        {k: _as_ids(v, k == "topics") for k, v in event_lists.items()}, pairs,
        budget=5, skip_recent=4, max_len=max(lengths) + 19, engaged=engaged)
    assert torch.equal(bounded[0], index) and torch.equal(bounded[1], valid)
    assert not index[~valid].any()  # empty slots hold position 0
    assert any(len(found) == 5 for found in want) and any(len(f) < 5 for f in want)
    # Valid slots come first, in order.
    assert torch.equal(valid, valid.sort(dim=1, descending=True).values)


def test_nothing_older_than_the_window_retrieves_nothing():
    offsets, owner = torch.tensor([0, 3]), torch.tensor([0, 0])
    ids = {"a": torch.tensor([1, 1])}
    index, valid = retrieve_matching_events(offsets, owner, ids, {"a": torch.tensor([1, 1, 1])},
                                            [("a", "a")], budget=4, skip_recent=3,
                                            max_len=3)
    assert index.shape == (2, 4) and not valid.any()


def test_the_model_scores_retrieved_events_and_counts_their_flops():
    from torch.utils.flop_counter import FlopCounterMode

    from gem_core.testing.models import small_model, synthetic_batch

    schema, batch = synthetic_batch(8, max_seq_len=64, seed=2, candidates=2)
    model = small_model(schema, attribute_attention=True, attribute_attention_history=4,
                        attribute_attention_retrieve=6)
    with FlopCounterMode(display=False) as counter:
        logits = model(batch)
    analytic = model.flops_by_module(batch.seq_lengths(), batch.candidate_offsets.diff(),
                                     dense=True)
    assert sum(analytic.values()) == pytest.approx(counter.get_total_flops(), rel=0.01)
    assert all(torch.isfinite(v).all() for v in logits.values())
    engaged = small_model(schema, attribute_attention=True, attribute_attention_history=4,
                          attribute_attention_retrieve=6,
                          attribute_attention_retrieve_engaged=True, action_feature="action")
    assert all(torch.isfinite(v).all() for v in engaged(batch).values())
    with pytest.raises(ValueError, match="attribute_attention_retrieve searches the events"):
        small_model(schema, attribute_attention=True, attribute_attention_history=0,
                    attribute_attention_retrieve=6)
