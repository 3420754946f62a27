"""Engaged ranks in the event tokens (``model.engaged_ranks``): each event's rank within its
kind, engaged or viewed, against a plain-Python oracle; the token's embedding; the model's
validation, and a model with them that trains a step and exports."""

from __future__ import annotations

import random

import pytest
import torch

from gem_core.model.target_match import rank_bucket
from gem_core.model.tokens import LONGEST_RANKED, EventTokenizer, ranks_within_kind
from gem_core.testing.models import small_model, synthetic_batch


def _oracle_ranks(lengths: list[int], engaged: list[bool]) -> list[int]:
    """Per history, walking from its latest event back, a running count per kind."""
    ranks, start = [0] * len(engaged), 0
    for length in lengths:
        seen = {True: 0, False: 0}
        for e in reversed(range(start, start + length)):
            seen[engaged[e]] += 1
            ranks[e] = seen[engaged[e]]
        start += length
    return ranks


@pytest.mark.parametrize("seed", range(5))
def test_ranks_within_kind_match_the_oracle(seed):
    rng = random.Random(seed)
    lengths = [rng.choice([0, 1, 2, 7, 30]) for _ in range(rng.randint(1, 6))]
    engaged = [rng.random() < 0.2 for _ in range(sum(lengths))]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    got = ranks_within_kind(offsets, torch.tensor(engaged, dtype=torch.bool))
    assert got.tolist() == _oracle_ranks(lengths, engaged)


def test_an_empty_batch_has_no_ranks():
    got = ranks_within_kind(torch.zeros(3, dtype=torch.int64), torch.zeros(0, dtype=torch.bool))
    assert got.shape == (0,)


def test_the_token_adds_the_embedding_of_each_rank_bucket():
    torch.manual_seed(0)
    tokenizer = EventTokenizer(8, 6, 0, position_buckets=4, engaged_ranks=True).double()
    plain = EventTokenizer(8, 6, 0, position_buckets=4).double()
    plain.load_state_dict({k: v for k, v in tokenizer.state_dict().items()
                           if not k.startswith("rank.")})
    lengths, engaged = [40, 3], [i % 9 == 0 for i in range(43)]
    offsets = torch.tensor([0, 40, 43])
    vectors = torch.randn(43, 8, dtype=torch.float64)
    ages = torch.randint(0, 10_000, (43,))
    flags = torch.tensor(engaged)
    got = tokenizer(vectors, ages, offsets, None, flags) - plain(vectors, ages, offsets, None)
    ranks = torch.tensor(_oracle_ranks(lengths, engaged))
    torch.testing.assert_close(got, tokenizer.rank.weight[rank_bucket(ranks, LONGEST_RANKED)])
    # Ranks past 16 share buckets by doubling: the 30th view and the 31st share one.
    assert rank_bucket(torch.tensor([30, 31, 33]), LONGEST_RANKED).tolist() == [17, 17, 18]
    with pytest.raises(ValueError, match="engaged ranks need each event's engaged flag"):
        tokenizer(vectors, ages, offsets, None)


def test_the_model_needs_the_action_feature():
    data_schema, _ = synthetic_batch(2, max_seq_len=8)
    with pytest.raises(ValueError, match="model.engaged_ranks needs model.action_feature"):
        small_model(data_schema, engaged_ranks=True)
    with pytest.raises(ValueError, match="action_feature = 'nope' is not an event feature"):
        small_model(data_schema, engaged_ranks=True, action_feature="nope")


def test_ranks_reach_the_model_and_its_gradients():
    """A model with engaged ranks (0 is the synthetic source's view action): its output moves
    with which events are engaged, where one without them does not see the difference through
    its tokens' ranks, and the rank table gets gradients."""
    data_schema, batch = synthetic_batch(16, max_seq_len=32, seed=2, candidates=2)
    model = small_model(data_schema, engaged_ranks=True, action_feature="action", view_action=0)
    logits = model(batch)
    sum(v.sum() for v in logits.values()).backward()
    assert model.events.rank.weight.grad.abs().sum() > 0
    assert small_model(data_schema).events.rank is None
