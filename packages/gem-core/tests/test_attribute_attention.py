"""Attribute attention (gem_core.model.attribute_attention) against a float64 loop oracle that
reads the module's weights as the docstring's formula names them, and in the model."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from gem_core.model.attribute_attention import AttributeAttention
from gem_core.testing.models import small_model, synthetic_batch

PAIRS = [("ad", "ad"), ("topics", "topics"), ("category", "category")]


def _rms(vector):
    return vector / torch.sqrt(torch.mean(vector * vector) + 1e-6)


def _pre_activation(module: AttributeAttention, candidate_vectors, event_vectors, events,
                    history, n: int, e: int):
    """The scorer's pre-activation for candidate ``n`` and event ``e``, term by term."""
    num, dim = len(module.pairs), events.shape[1]
    w_candidate, w_event = module.candidate_terms.weight, module.event_terms.weight
    pre = module.candidate_terms.bias + module.token_terms.weight @ _rms(events[e])
    if module.tower_terms is not None and history is not None:
        pre = pre + module.tower_terms.weight @ _rms(history[e])
    for p, (c_name, e_name) in enumerate(module.pairs):
        q, k = _rms(candidate_vectors[c_name][n]), _rms(event_vectors[e_name][e])
        a = w_candidate[:, p * dim:(p + 1) * dim]
        a2 = w_candidate[:, (num + p) * dim:(num + p + 1) * dim]
        b = w_event[:, p * dim:(p + 1) * dim]
        b2 = w_event[:, (num + p) * dim:(num + p + 1) * dim]
        pre = pre + a @ q + a2 @ (q * q) + b @ k + b2 @ (k * k)
        pre = pre + module.products[p].T @ (q * k)
        pre = pre + module.similarities[p] * torch.dot(q, k) / dim
    return pre


def _oracle(module: AttributeAttention, candidate_vectors, event_vectors, events, history,
            offsets, owner, window):
    """Candidate by candidate, event by event, attribute by attribute."""
    num, dim = len(module.pairs), events.shape[1]
    out = []
    for n in range(owner.numel()):
        request = int(owner[n])
        start, end = int(offsets[request]), int(offsets[request + 1])
        first = max(start, end - window) if window else start
        total = torch.zeros(dim, dtype=torch.float64)
        for e in range(first, end):
            pre = _pre_activation(module, candidate_vectors, event_vectors, events, history, n, e)
            hidden = pre * torch.sigmoid(pre)
            weights = module.weights.weight @ hidden + module.weights.bias
            values = (module.values.weight @ _rms(events[e])).view(num, dim)
            for p in range(num):
                total = total + weights[p] * values[p]
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

