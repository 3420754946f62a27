"""Attribute attention (gem_core.model.attribute_attention) against a float64 loop oracle that
reads the module's weights as the docstring's formula names them, and in the model."""

from __future__ import annotations

import copy

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
        if module.query_maps is not None:  # M_p and N_p, then back to unit RMS
            q, k = _rms(module.query_maps[p] @ q), _rms(module.key_maps[p] @ k)
        a = w_candidate[:, p * dim:(p + 1) * dim]
        a2 = w_candidate[:, (num + p) * dim:(num + p + 1) * dim]
        b = w_event[:, p * dim:(p + 1) * dim]
        b2 = w_event[:, (num + p) * dim:(num + p + 1) * dim]
        pre = pre + a @ q + a2 @ (q * q) + b @ k + b2 @ (k * k)
        pre = pre + module.products[p].T @ (q * k)
        similarity = module.similarities[p]
        if module.match_by_event is not None:  # T_p x_e: the match scaled by the event's token
            rows = module.match_by_event.weight[p * module.hidden:(p + 1) * module.hidden]
            similarity = similarity + rows @ _rms(events[e])
        pre = pre + similarity * torch.dot(q, k) / dim
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
        # Latest-match heads: walk from the most recent event back, each head keeping the mass
        # its gates have not yet taken.
        heads = module.latest
        left = torch.ones(heads, dtype=torch.float64)
        read = torch.zeros(heads, module.hidden + dim, dtype=torch.float64)
        for e in reversed(range(first, end)):
            pre = _pre_activation(module, candidate_vectors, event_vectors, events, history, n, e)
            hidden = pre * torch.sigmoid(pre)
            weights = module.weights.weight @ hidden + module.weights.bias
            values = (module.values.weight @ _rms(events[e])).view(num, dim)
            for p in range(num):
                total = total + weights[p] * values[p]
            for j in range(heads):
                gate = torch.sigmoid(module.latest_gates.weight[j] @ hidden
                                     + module.latest_gates.bias[j])
                read[j] = read[j] + left[j] * gate * torch.cat([hidden, _rms(events[e])])
                left[j] = left[j] * (1 - gate)
        result = module.proj.weight @ total + module.proj.bias
        if heads:
            flat = torch.cat([read, left.unsqueeze(1)], dim=1).flatten()
            result = result + module.latest_proj.weight @ flat + module.latest_proj.bias
        out.append(result)
    return torch.stack(out)


def _output_with_nothing_found(module: AttributeAttention) -> torch.Tensor:
    """What a candidate with no event gets: the output biases, and the latest-match heads'
    read of nothing (no pooled hidden units or token, all of the gates' mass left)."""
    out = module.proj.bias
    if module.latest:
        nothing = torch.zeros(module.latest, module.hidden + module.proj.in_features + 1,
                              dtype=torch.float64)
        nothing[:, -1] = 1
        out = out + module.latest_proj(nothing.flatten())
    return out


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
@pytest.mark.parametrize(("latest", "match_by_event", "maps"),
                         [(0, False, False), (2, False, False), (0, True, False),
                          (2, True, False), (0, False, True), (2, True, True)])
def test_matches_the_loop_oracle_in_float64(window, tower_keys, latest, match_by_event, maps):
    torch.manual_seed(0)
    module = AttributeAttention(8, PAIRS, history=window, hidden=6, tower_keys=tower_keys,
                                latest=latest, match_by_event=match_by_event,
                                maps=maps).double()
    for parameter in module.parameters():  # nothing at its zero init
        torch.nn.init.normal_(parameter, std=0.3)
    lengths, candidates = [5, 0, 7, 1], [2, 3, 1, 2]
    inputs = _inputs(1, lengths, candidates)
    history = inputs[3] if tower_keys else None
    got = module(inputs[0], inputs[1], inputs[2], history, inputs[4], inputs[5], max(lengths))
    want = _oracle(module, inputs[0], inputs[1], inputs[2], history, inputs[4], inputs[5],
                   window)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    # The request with no history: its candidates see only the output biases (and the
    # latest-match heads' "found nothing" mass of 1).
    torch.testing.assert_close(got[2:5], _output_with_nothing_found(module).expand(3, -1))


def test_latest_match_heads_tell_two_orders_of_the_same_events_apart():
    """The same two events in opposite orders: the sum alone cannot tell them apart, the
    latest-match heads do (what came last differs)."""
    torch.manual_seed(0)
    inputs = _inputs(4, [2], [1])
    swapped = [dict(inputs[0]), {k: v[[1, 0]] for k, v in inputs[1].items()}, inputs[2][[1, 0]],
               inputs[3][[1, 0]], inputs[4], inputs[5]]
    outputs = {}
    for latest in (0, 2):
        module = AttributeAttention(8, PAIRS, history=0, hidden=6, tower_keys=True,
                                    latest=latest).double()
        for parameter in module.parameters():
            torch.nn.init.normal_(parameter, std=0.3)
        outputs[latest] = (module(*inputs, 2), module(*swapped, 2))
    torch.testing.assert_close(*outputs[0], rtol=1e-12, atol=1e-12)
    assert (outputs[2][0] - outputs[2][1]).abs().max() > 1e-3


def test_an_empty_batch_of_events_and_gradients_reach_every_parameter():
    module = AttributeAttention(8, PAIRS, history=4, hidden=6, tower_keys=True,
                                latest=2, match_by_event=True, maps=True).double()
    inputs = _inputs(2, [0, 0], [1, 2])
    out = module(inputs[0], inputs[1], inputs[2], inputs[3], inputs[4], inputs[5], 0)
    torch.testing.assert_close(out, _output_with_nothing_found(module).expand(3, -1))
    inputs = _inputs(3, [4, 6], [2, 1])
    module(*inputs, 6).sum().backward()
    for name, parameter in module.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name


def test_needs_a_shared_attribute():
    with pytest.raises(ValueError, match="model.attribute_attention needs a candidate feature "
                                         "and an event feature that share a table"):
        AttributeAttention(8, [], history=4, hidden=4, tower_keys=False)


@pytest.mark.parametrize("option", [{"attribute_attention_latest": 2},
                                    {"attribute_attention_match_by_event": True},
                                    {"attribute_attention_maps": True},
                                    {"attribute_attention_loss": 0.5}])
def test_its_options_need_it(option):
    schema, _ = synthetic_batch(2, max_seq_len=8, seed=0, candidates=1)
    with pytest.raises(ValueError, match="are options of attribute attention: they need "
                                         "attribute_attention = true"):
        small_model(schema, **option)


@pytest.mark.parametrize(("history", "latest", "match_by_event", "maps", "loss"),
                         [(0, 0, False, False, 0.0), (5, 0, False, False, 0.0),
                          (0, 2, False, False, 0.0), (5, 0, True, False, 0.0),
                          (5, 2, False, True, 0.5)])
def test_in_the_model_its_flops_are_counted(history, latest, match_by_event, maps, loss):
    schema, batch = synthetic_batch(10, max_seq_len=24, seed=1, candidates=3)
    model = small_model(schema, attribute_attention=True, attribute_attention_history=history,
                        attribute_attention_latest=latest,
                        attribute_attention_match_by_event=match_by_event,
                        attribute_attention_maps=maps, attribute_attention_loss=loss,
                        target_match=4)
    with FlopCounterMode(display=False) as counter:
        logits = model(batch)
    analytic = model.flops_by_module(batch.seq_lengths(), batch.candidate_offsets.diff(),
                                     dense=True)
    assert analytic["attribute_attention"] > 0
    assert sum(analytic.values()) == pytest.approx(counter.get_total_flops(), rel=0.01)
    assert all(torch.isfinite(v).all() for v in logits.values())



def test_a_match_weighs_by_the_event_from_the_first_step():
    """Two events that both match the candidate on every attribute and differ only in their
    token (a purchase and a page view of its advertiser): beyond the additive terms, their
    hidden units differ by ``sum_p T_p (x_0 - x_1)`` (each cosine is 1) with
    ``match_by_event``, and by nothing more without it."""
    torch.manual_seed(0)
    inputs = list(_inputs(5, [2], [1]))
    for name in inputs[1]:
        inputs[1][name][1] = inputs[1][name][0] = inputs[0][name][0]
    module = AttributeAttention(8, PAIRS, history=0, hidden=6, tower_keys=False,
                                match_by_event=True).double()
    for parameter in module.parameters():
        torch.nn.init.normal_(parameter, std=0.3)

    def difference():
        pre = [_pre_activation(module, inputs[0], inputs[1], inputs[2], None, 0, e)
               for e in (0, 1)]
        return pre[0] - pre[1]

    with_map = difference()
    maps = module.match_by_event.weight.detach().view(len(PAIRS), 6, 8).sum(0)
    with torch.no_grad():
        module.match_by_event.weight.zero_()
    want = maps @ (_rms(inputs[2][0]) - _rms(inputs[2][1]))
    torch.testing.assert_close(with_map - difference(), want, rtol=1e-5, atol=1e-5)
    assert want.abs().max() > 0.1


def test_maps_start_as_the_module_without_them_and_learn_a_similarity_the_rows_lack():
    """At the identity the maps change nothing (to the normalisation's epsilon). Then two
    attributes whose rows are orthogonal (cosine 0: nothing in the table says they are
    alike) can be made similar by the maps alone: with ``N_p`` sending the event's row onto
    the candidate's, the cosine the scorer reads is 1, as for equal attributes."""
    torch.manual_seed(0)
    plain = AttributeAttention(8, PAIRS, history=0, hidden=6, tower_keys=False).double()
    mapped = AttributeAttention(8, PAIRS, history=0, hidden=6, tower_keys=False,
                                maps=True).double()
    mapped.load_state_dict(plain.state_dict(), strict=False)
    inputs = _inputs(6, [3, 2], [2, 1])
    # (to the normalisation's epsilon: a unit vector normalised again moves by 5e-7)
    torch.testing.assert_close(mapped(*inputs, 3), plain(*inputs, 3), rtol=1e-5, atol=1e-5)

    inputs = list(_inputs(7, [1], [1]))
    candidate = torch.zeros(8, dtype=torch.float64)
    candidate[0] = 1.0
    sibling = torch.zeros(8, dtype=torch.float64)
    sibling[1] = 1.0  # orthogonal to the candidate's row
    inputs[0]["category"][0], inputs[1]["category"][0] = candidate, sibling

    def cosine():
        q, k = _rms(candidate), _rms(sibling)
        q, k = _rms(mapped.query_maps[2].detach() @ q), _rms(mapped.key_maps[2].detach() @ k)
        return float(torch.dot(q, k) / 8)

    assert cosine() == pytest.approx(0.0)
    swap = torch.eye(8, dtype=torch.float64)[[1, 0, *range(2, 8)]]
    with torch.no_grad():
        mapped.key_maps[2].copy_(swap)
    assert cosine() == pytest.approx(1.0, abs=1e-5)
    # and the module reads it: its output is that of an event with the candidate's own row
    same = [dict(inputs[0]), {k: v.clone() for k, v in inputs[1].items()}, *inputs[2:]]
    same[1]["category"][0] = candidate
    with torch.no_grad():
        mapped.key_maps[2].copy_(torch.eye(8))
    want = mapped(*same, 1)
    with torch.no_grad():
        mapped.key_maps[2].copy_(swap)
    torch.testing.assert_close(mapped(*inputs, 1), want, rtol=1e-12, atol=1e-12)


def test_its_own_loss_reads_its_token_alone_in_training_and_leaves_the_prediction_alone():
    """``attribute_attention_loss``: in training the model reports ``weight * sum_t sum_n
    BCE(head_t(token_n), label_t,n)`` (float64 from the token captured in the forward)
    among its per-impression loss sums; its gradient reaches attribute attention and not the task
    heads; the logits are those of the model without it, and evaluation reports nothing."""
    schema, batch = synthetic_batch(6, max_seq_len=16, seed=2, candidates=3)
    with_loss = small_model(schema, attribute_attention=True, attribute_attention_loss=0.5,
                            target_match=4)
    without = small_model(schema, attribute_attention=True, target_match=4)
    without.load_state_dict(with_loss.state_dict(), strict=False)
    captured = {}
    hook = with_loss.attribute_attention.register_forward_hook(
        lambda module, args, out: captured.update(token=out))
    logits = with_loss(batch)
    hook.remove()
    torch.testing.assert_close(logits, without(batch), rtol=0, atol=0)
    token = captured["token"].double()  # match_token_scale "linear": as the module gives it
    weight, bias = (p.detach().double() for p in (with_loss.path_loss.heads.weight,
                                                  with_loss.path_loss.heads.bias))
    want = sum(torch.nn.functional.binary_cross_entropy_with_logits(
        token @ weight[i] + bias[i], batch.labels[task].double(), reduction="sum")
        for i, task in enumerate(schema.tasks)) * 0.5
    assert "learned_path" not in with_loss.auxiliary_losses()  # a sum, not a per-rank mean
    got = with_loss.impression_loss_sums()["learned_path"]
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    # evaluation replicas and embedding sharders deep-copy a model after training forwards
    assert copy.deepcopy(with_loss).impression_loss_sums() == {}
    got.backward()
    assert with_loss.attribute_attention.proj.weight.grad.abs().sum() > 0
    assert all(head.weight.grad is None for head in with_loss.heads.values())
    with_loss.eval()
    with_loss(batch)
    assert with_loss.impression_loss_sums() == {}
