"""Attribute attention (gem_core.model.attribute_attention) against a float64 loop oracle that
reads the module's weights as the docstring's formula names them, and in the model."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from gem_core.jagged import Jagged, offsets_from_lengths
from gem_core.model.attribute_attention import AttributeAttention, soft_overlap
from gem_core.testing.models import small_model, synthetic_batch

PAIRS = [("ad", "ad"), ("topics", "topics"), ("category", "category")]


def _rms(vector):
    return vector / torch.sqrt(torch.mean(vector * vector) + 1e-6)


def _soft_overlap(candidate_values: list, event_values: list) -> torch.Tensor:
    """The sum over the candidate's values of each one's best cosine with the event's."""
    total = torch.zeros((), dtype=torch.float64)
    for a in candidate_values:
        total = total + max(torch.dot(_rms(a), _rms(b)) / a.numel() for b in event_values)
    return total


def _evolution_oracle(evolution, inputs: list) -> torch.Tensor:
    """The GRU of the interest-evolution docstring, one event at a time, newest first."""
    width = evolution.width
    w_in, b_in = evolution.input_gates.weight, evolution.input_gates.bias
    w_st, b_st = evolution.state_gates.weight, evolution.state_gates.bias
    state = torch.zeros(width, dtype=torch.float64)
    for a in inputs:
        gate_in, gate_st = w_in @ a + b_in, w_st @ state + b_st
        reset = torch.sigmoid(gate_in[:width] + gate_st[:width])
        update = torch.sigmoid(gate_in[width:2 * width] + gate_st[width:2 * width])
        candidate = torch.tanh(gate_in[2 * width:] + reset * gate_st[2 * width:])
        state = (1 - update) * candidate + update * state
    return evolution.out.weight @ state


def _values_of(values, row):
    """Row ``row`` of a feature's unpooled vectors (a plain tensor: a set of one)."""
    if isinstance(values, Jagged):
        return list(values.values[int(values.offsets[row]):int(values.offsets[row + 1])])
    return [values[row]]


def _oracle(module: AttributeAttention, candidate_vectors, event_vectors, events, history,
            offsets, owner, window, candidate_values=None, event_values=None):
    """Candidate by candidate, event by event, attribute by attribute."""
    num, dim = len(module.pairs), events.shape[1]
    w_candidate = module.candidate_terms.weight
    w_event = module.event_terms.weight
    out = []
    for n in range(owner.numel()):
        request = int(owner[n])
        start, end = int(offsets[request]), int(offsets[request + 1])
        first = max(start, end - window) if window else start
        total = torch.zeros(dim, dtype=torch.float64)
        activations = []  # the scorer's hidden activations, oldest event first
        for e in range(first, end):
            pre = module.candidate_terms.bias.clone()
            pre = pre + module.token_terms.weight @ _rms(events[e])
            if module.tower_terms is not None and history is not None:
                pre = pre + module.tower_terms.weight @ _rms(history[e])
            for p, (c_name, e_name) in enumerate(module.pairs):
                q = _rms(candidate_vectors[c_name][n])
                k = _rms(event_vectors[e_name][e])
                a = w_candidate[:, p * dim:(p + 1) * dim]
                a2 = w_candidate[:, (num + p) * dim:(num + p + 1) * dim]
                b = w_event[:, p * dim:(p + 1) * dim]
                b2 = w_event[:, (num + p) * dim:(num + p + 1) * dim]
                pre = pre + a @ q + a2 @ (q * q) + b @ k + b2 @ (k * k)
                pre = pre + module.products[p].T @ (q * k)
                pre = pre + module.similarities[p] * torch.dot(q, k) / dim
                if p in module.overlap_pairs:
                    o = module.overlap_pairs.index(p)
                    pre = pre + module.overlaps[o] * _soft_overlap(
                        _values_of(candidate_values.get(c_name, candidate_vectors[c_name]), n),
                        _values_of(event_values.get(e_name, event_vectors[e_name]), e))
            hidden = pre * torch.sigmoid(pre)
            activations.append(hidden)
            weights = module.weights.weight @ hidden + module.weights.bias
            values = (module.values.weight @ _rms(events[e])).view(num, dim)
            for p in range(num):
                total = total + weights[p] * values[p]
        if module.evolution is not None:
            total = total + _evolution_oracle(module.evolution, activations[::-1])
        out.append(module.proj.weight @ total + module.proj.bias)
    return torch.stack(out)


def _inputs(seed: int, lengths: list[int], candidates: list[int], dim: int = 8):
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    owner = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(candidates))
    events_total, n = int(offsets[-1]), owner.numel()

    def normal(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    candidate_vectors = {c: normal(n, dim) for c, _ in PAIRS}
    event_vectors = {e: normal(events_total, dim) for _, e in PAIRS}
    # Plant equal attribute vectors (an event of the candidate's advertiser), as lookups of
    # one id in one table give.
    if events_total:
        event_vectors["ad"][0] = candidate_vectors["ad"][0]
    return (candidate_vectors, event_vectors, normal(events_total, dim),
            normal(events_total, dim), offsets, owner)


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("tower_keys", [True, False])
def test_matches_the_loop_oracle_in_float64(window, tower_keys):
    torch.manual_seed(0)
    module = AttributeAttention(8, PAIRS, history=window, hidden=6,
                                tower_keys=tower_keys).double()
    for parameter in module.parameters():  # nothing at its zero init
        torch.nn.init.normal_(parameter, std=0.3)
    lengths, candidates = [5, 0, 7, 1], [2, 3, 1, 2]
    inputs = _inputs(1, lengths, candidates)
    history = inputs[3] if tower_keys else None
    got = module(inputs[0], inputs[1], inputs[2], history, inputs[4], inputs[5], max(lengths))
    want = _oracle(module, inputs[0], inputs[1], inputs[2], history, inputs[4], inputs[5],
                   window)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    # The request with no history: its candidates see only the output bias.
    torch.testing.assert_close(got[2:5], module.proj.bias.expand(3, -1))


def test_an_empty_batch_of_events_and_gradients_reach_every_parameter():
    module = AttributeAttention(8, PAIRS, history=4, hidden=6, tower_keys=True).double()
    inputs = _inputs(2, [0, 0], [1, 2])
    out = module(inputs[0], inputs[1], inputs[2], inputs[3], inputs[4], inputs[5], 0)
    torch.testing.assert_close(out, module.proj.bias.expand(3, -1))
    inputs = _inputs(3, [4, 6], [2, 1])
    module(*inputs, 6).sum().backward()
    for name, parameter in module.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name


def test_needs_a_shared_attribute():
    with pytest.raises(ValueError, match="model.attribute_attention needs a candidate feature "
                                         "and an event feature that share a table"):
        AttributeAttention(8, [], history=4, hidden=4, tower_keys=False)


@pytest.mark.parametrize("history", [0, 5])
def test_in_the_model_its_flops_are_counted(history):
    schema, batch = synthetic_batch(10, max_seq_len=24, seed=1, candidates=3)
    model = small_model(schema, attribute_attention=True, attribute_attention_history=history,
                        target_match=4)
    with FlopCounterMode(display=False) as counter:
        logits = model(batch)
    analytic = model.flops_by_module(batch.seq_lengths(), batch.candidate_offsets.diff(),
                                     dense=True)
    assert analytic["attribute_attention"] > 0
    assert sum(analytic.values()) == pytest.approx(counter.get_total_flops(), rel=0.01)
    assert all(torch.isfinite(v).all() for v in logits.values())


def _multi_valued(generator, rows: int, dim: int, widest: int) -> Jagged:
    """1 to ``widest`` random value vectors per row."""
    lengths = torch.randint(1, widest + 1, (rows,), generator=generator)
    values = torch.randn(int(lengths.sum()), dim, generator=generator, dtype=torch.float64)
    return Jagged(values, offsets_from_lengths(lengths))


@pytest.mark.parametrize("window", [0, 3])
def test_the_overlap_counts_match_the_loop_oracle_in_float64(window):
    """Topics multi-valued on both sides, a candidate side multi-valued against a
    single-valued event side (category), and a single-valued pair without an overlap."""
    torch.manual_seed(0)
    pairs = [("ad", "ad"), ("topics", "topics"), ("categories", "category")]
    module = AttributeAttention(8, pairs, history=window, hidden=6, tower_keys=True,
                                overlap_pairs=(1, 2)).double()
    for parameter in module.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    lengths, candidates = [5, 0, 7, 1], [2, 3, 1, 2]
    generator = torch.Generator().manual_seed(4)
    offsets = offsets_from_lengths(torch.tensor(lengths))
    owner = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(candidates))
    events_total, n = int(offsets[-1]), owner.numel()
    candidate_values = {"topics": _multi_valued(generator, n, 8, 3),
                        "categories": _multi_valued(generator, n, 8, 2)}
    event_values = {"topics": _multi_valued(generator, events_total, 8, 4)}
    # Plant shared values: the first candidate's first topic is event 1's last one.
    event_values["topics"].values[int(event_values["topics"].offsets[2]) - 1] = \
        candidate_values["topics"].values[0]

    def normal(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    candidate_vectors = {"ad": normal(n, 8), "topics": normal(n, 8), "categories": normal(n, 8)}
    event_vectors = {"ad": normal(events_total, 8), "topics": normal(events_total, 8),
                     "category": normal(events_total, 8)}
    events, history = normal(events_total, 8), normal(events_total, 8)
    got = module(candidate_vectors, event_vectors, events, history, offsets, owner,
                 max(lengths), candidate_values=candidate_values, event_values=event_values)
    want = _oracle(module, candidate_vectors, event_vectors, events, history, offsets, owner,
                   window, candidate_values, event_values)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="overlap pairs need the unpooled vectors"):
        module(candidate_vectors, event_vectors, events, history, offsets, owner, max(lengths))


def test_with_one_hot_values_the_soft_overlap_counts_the_shared_values():
    """Orthogonal value vectors (as distinct ids are at their limit): the soft overlap of a
    candidate and an event is the number of the candidate's values the event holds."""
    one_hot = torch.eye(6, dtype=torch.float64)
    candidate = Jagged(one_hot[[0, 1, 2, 3, 5]], torch.tensor([0, 3, 5]))  # {0,1,2}, {3,5}
    event = Jagged(one_hot[[1, 2, 4, 4, 0, 3]], torch.tensor([0, 1, 4, 6]))  # {1}, {2,4,4}, {0,3}
    index = torch.tensor([[0, 1, 2], [0, 1, 2]])
    got = soft_overlap(candidate, event, index)
    # (to rms_norm's eps: 1e-6 against a mean square of 1/6)
    torch.testing.assert_close(got, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 1.0]],
                                                 dtype=torch.float64), rtol=0, atol=1e-5)


def _multi_valued_batch(seed: int, lengths: list[int], candidates: list[int]):
    """A schema with an ad id and multi-valued topics on events and candidates, and a random
    batch of it (ids from a small pool, so topics are shared)."""
    from gem_core.batch import JaggedBatch
    from gem_core.schema import EmbeddingTable, FeatureSchema, SequenceFeature

    schema = FeatureSchema(
        tables=[EmbeddingTable(name=t, num_embeddings=50, id_policy="hash")
                for t in ("ad", "action", "topic")],
        event_features=[SequenceFeature(name="ad", table="ad"),
                        SequenceFeature(name="action", table="action"),
                        SequenceFeature(name="topics", table="topic", multi_valued=True)],
        candidate_features=[SequenceFeature(name="ad", table="ad"),
                            SequenceFeature(name="topics", table="topic", multi_valued=True)],
        tasks=("click",))
    generator = torch.Generator().manual_seed(seed)
    events, n = sum(lengths), sum(candidates)

    def ids(rows):
        return torch.randint(0, 8, (rows,), generator=generator)

    def topics(rows, widest):
        counts = torch.randint(1, widest + 1, (rows,), generator=generator)
        return Jagged(ids(int(counts.sum())), offsets_from_lengths(counts))

    batch = JaggedBatch(
        seq_offsets=offsets_from_lengths(torch.tensor(lengths)),
        seq_timestamps=torch.arange(events, dtype=torch.int64),
        event_ids={"ad": ids(events), "action": ids(events) % 3, "topics": topics(events, 4)},
        request_timestamps=torch.full((len(lengths),), events + 10, dtype=torch.int64),
        candidate_offsets=offsets_from_lengths(torch.tensor(candidates)),
        candidate_ids={"ad": ids(n), "topics": topics(n, 3)},
        labels={"click": (ids(n) % 2).float()})
    return schema, batch


def test_in_the_model_the_overlap_is_counted_and_trains():
    schema, batch = _multi_valued_batch(0, [6, 0, 9, 3], [2, 1, 3, 2])
    assert batch.value_widths() == {"event.topics": int(batch.event_ids["topics"].lengths().max()),
                                    "candidate.topics":
                                        int(batch.candidate_ids["topics"].lengths().max())}
    model = small_model(schema, attribute_attention=True, attribute_attention_overlap=True,
                        attribute_attention_history=5)
    assert model.attribute_attention.pairs == [("ad", "ad"), ("topics", "topics")]
    assert model.attribute_attention.overlap_pairs == (1,)
    with FlopCounterMode(display=False) as counter:
        logits = model(batch)
    analytic = model.flops_by_module(batch.seq_lengths(), batch.candidate_offsets.diff(),
                                     dense=True, value_widths=batch.value_widths())
    assert sum(analytic.values()) == pytest.approx(counter.get_total_flops(), rel=0.01)
    without = small_model(schema, attribute_attention=True, attribute_attention_history=5)
    assert without.attribute_attention.overlaps is None
    assert (analytic["attribute_attention"] > without.flops_by_module(
        batch.seq_lengths(), batch.candidate_offsets.diff(), dense=True,
        value_widths=batch.value_widths())["attribute_attention"])
    sum(logit.sum() for logit in logits.values()).backward()
    assert model.attribute_attention.overlaps.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="attribute_attention_overlap is a part of "
                                         "attribute attention"):
        small_model(schema, attribute_attention_overlap=True)


@pytest.mark.parametrize("window", [0, 3])
def test_interest_evolution_matches_the_loop_oracle_in_float64(window):
    torch.manual_seed(0)
    module = AttributeAttention(8, PAIRS, history=window, hidden=6, tower_keys=True,
                                evolution=5).double()
    for parameter in module.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    lengths, candidates = [5, 0, 7, 1], [2, 3, 1, 2]
    inputs = _inputs(1, lengths, candidates)
    got = module(*inputs, max(lengths))
    want = _oracle(module, *inputs, window)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got[2:5], module.proj.bias.expand(3, -1))  # no history
    got.sum().backward()
    for name, parameter in module.evolution.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name


def test_interest_evolution_tells_the_order_of_two_events_apart():
    """Two histories holding the same events in opposite orders: a sum of per-event scores
    gives both the same output, the GRU does not."""
    torch.manual_seed(0)
    inputs = _inputs(5, [4, 4], [1, 1])
    events = inputs[2].clone()
    events[4:8] = events[0:4].flip(0)  # request 1: request 0's events, reversed
    event_vectors = {name: torch.cat([v[0:4], v[0:4].flip(0)]) for name, v in inputs[1].items()}
    candidate_vectors = {name: v[[0, 0]] for name, v in inputs[0].items()}
    for evolution, same in ((0, True), (4, False)):
        module = AttributeAttention(8, PAIRS, history=0, hidden=6, tower_keys=False,
                                    evolution=evolution).double()
        out = module(candidate_vectors, event_vectors, events, None, inputs[4], inputs[5], 4)
        assert torch.allclose(out[0], out[1], rtol=1e-12, atol=1e-12) == same


def test_in_the_model_interest_evolution_is_counted():
    schema, batch = synthetic_batch(10, max_seq_len=24, seed=1, candidates=3)
    model = small_model(schema, attribute_attention=True, attribute_attention_history=6,
                        attribute_attention_evolution=4)
    with FlopCounterMode(display=False) as counter:
        model(batch)
    analytic = model.flops_by_module(batch.seq_lengths(), batch.candidate_offsets.diff(),
                                     dense=True)
    assert sum(analytic.values()) == pytest.approx(counter.get_total_flops(), rel=0.01)
    with pytest.raises(ValueError, match="attribute_attention_evolution is a part of "
                                         "attribute attention"):
        small_model(schema, attribute_attention_evolution=4)
