"""The GEM model's parts: key gathering, ESMM, PMA independence from the candidate, cross- and
Wukong blocks, and every switch training end to end (forward and backward)."""

import logging
import math

import attrs
import pytest
import torch

from gem_core.attention.reference import ReferenceAttention
from gem_core.model.cross_attention import CrossFeatureAttention
from gem_core.model.heads import product_logit
from gem_core.model.interaction import log_magnitude
from gem_core.model.target_attention import gather_keys
from gem_core.model.wukong import WukongInteraction
from gem_core.testing.models import small_model, synthetic_batch


@pytest.fixture(scope="module")
def data():
    return synthetic_batch(10, max_seq_len=40, seed=1)


_model = small_model


@pytest.mark.parametrize("recent", [0, 1, 3])
@pytest.mark.parametrize("num_user", [0, 2])
def test_gather_keys_is_user_tokens_then_recent_history(recent, num_user):
    lengths = torch.tensor([0, 5, 2, 1])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    history = torch.randn(int(lengths.sum()), 4)
    user = torch.randn(4, num_user, 4) if num_user else None
    keys, kv_offsets = gather_keys(history, offsets, user, recent)
    for b in range(4):
        events = history[offsets[b]:offsets[b + 1]]
        events = events[-recent:] if recent else events
        expected = events if user is None else torch.cat([user[b], events])
        assert torch.equal(keys[kv_offsets[b]:kv_offsets[b + 1]], expected)


def test_esmm_product_logit_is_exact_and_stable():
    a = torch.tensor([-3.0, 0.0, 2.0, 40.0, -60.0, 60.0], dtype=torch.float64)
    b = torch.tensor([1.0, 0.5, -2.0, 40.0, -60.0, -60.0], dtype=torch.float64)
    p = torch.sigmoid(a) * torch.sigmoid(b)
    got = product_logit(a, b)
    moderate = slice(0, 3)
    assert torch.allclose(got[moderate], torch.log(p / (1 - p))[moderate], atol=1e-10)
    assert torch.isfinite(got).all()
    assert got[4] == pytest.approx(-120.0, abs=1e-6)  # log p, far below underflow of p itself
    # p(conversion) never exceeds p(click), and gradients stay finite at saturation.
    x = torch.randn(1000) * 20
    y = torch.randn(1000, requires_grad=True)
    combined = product_logit(x, y * 20)
    assert (combined <= x + 1e-4).all()
    combined.sum().backward()
    assert torch.isfinite(y.grad).all()


def test_user_tokens_do_not_depend_on_the_candidate(data):
    schema, batch = data
    model = _model(schema, pma_queries=3, cross_attention=True, target_queries="all")
    captured = []
    model.pma.register_forward_hook(lambda module, args, out: captured.append(out))
    items = schema.table("item").num_embeddings
    other = attrs.evolve(batch, candidate_ids={
        k: (v + 7) % items if k == "item" else torch.zeros_like(v)
        for k, v in batch.candidate_ids.items()})
    with torch.no_grad():
        first, second = model(batch), model(other)
    assert torch.equal(captured[0], captured[1])
    assert not torch.equal(first["click"], second["click"])


def test_cross_attention_starts_as_identity():
    block = CrossFeatureAttention(8, 2, ReferenceAttention())
    x = torch.randn(7, 8)
    offsets = torch.tensor([0, 3, 3, 7])
    assert torch.equal(block(x, offsets, 4, torch.randn(3, 2, 8)), x)


def test_wukong_changes_token_count_through_a_learned_residual():
    wukong = WukongInteraction(5, 8, layers=3, rank=2, fmb_tokens=3, lcb_tokens=1, mlp_dim=16,
                               hidden=(12,), dropout=0.0)
    assert wukong(torch.randn(4, 5, 8)).shape == (4, 12)
    assert wukong.layers[0].residual is not None and wukong.layers[1].residual is None


@pytest.mark.parametrize("switches", [
    dict(pma_queries=2, history_mean=False, interaction="wukong", multitask="esmm"),
    dict(cross_attention=True, target_queries="all", target_history=4, normalization="silu"),
    dict(num_layers=0, target_attention=False),
    dict(target_attention=False, pma_queries=1),
    dict(target_match=8, attribute_attention=True, match_token_scale="log"),
    dict(candidate_bias=True, multitask="esmm"),
    dict(interaction="cross", cross_rank=4, pma_queries=1),
    dict(dense_tokens="per_feature", cross_attention=True, interaction="wukong"),
    dict(token_norm="batch", interaction="cross", target_match=8, attribute_attention=True),
    dict(token_norm="rms", target_match=8, attribute_attention=True),
    dict(target_match=8, target_match_latest=True, action_feature="action"),
    dict(target_match=8, target_match_latest="with_actions", action_feature="schema",
         target_match_latest_window=1024),
])
def test_every_switch_trains(data, switches):
    schema, batch = data
    model = _model(schema, **switches)
    out = model(batch)
    assert set(out) == set(schema.tasks)
    loss = sum(torch.nn.functional.binary_cross_entropy_with_logits(out[t], batch.labels[t])
               for t in out)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    if switches.get("multitask") == "esmm":
        assert (torch.sigmoid(out["conversion"]) <= torch.sigmoid(out["click"]) + 1e-6).all()


def test_log_magnitude_keeps_direction_and_compresses_size():
    torch.manual_seed(0)
    # Rows from tiny to large, as target match and attribute attention produce them.
    tokens = torch.randn(6, 32, dtype=torch.float64) * torch.tensor(
        [1e-3, 0.1, 1.0, 13.0, 26.0, 500.0], dtype=torch.float64).unsqueeze(1)
    out = log_magnitude(tokens)
    for row, scaled in zip(tokens, out):
        rms = float(row.pow(2).mean().sqrt())
        assert float(scaled.pow(2).mean().sqrt()) == pytest.approx(math.log1p(rms),
                                                                  rel=1e-9)
        assert float(torch.nn.functional.cosine_similarity(row, scaled, dim=0)) == \
            pytest.approx(1.0, abs=1e-12)
    # The order of sizes survives; the range shrinks (26 -> 3.3, 500 -> 6.2).
    sizes = out.pow(2).mean(dim=1).sqrt()
    assert torch.all(sizes[1:] > sizes[:-1]) and float(sizes[-1]) < 7
    assert torch.equal(log_magnitude(torch.zeros(2, 4)), torch.zeros(2, 4))


def test_match_token_scale_rescales_the_match_tokens_only(data):
    schema, batch = data
    linear = _model(schema, target_match=8, attribute_attention=True)
    logged = _model(schema, target_match=8, attribute_attention=True, match_token_scale="log")
    seen = {}
    for name, model in (("linear", linear), ("log", logged)):
        model.interaction.register_forward_pre_hook(
            lambda mod, args, name=name: seen.__setitem__(name, args[0].detach()))
        model(batch)
    a, b = seen["linear"], seen["log"]
    # Tokens: candidate, target attention, target match, attribute attention, history mean, ...
    matched = [2, 3]
    others = [i for i in range(a.shape[1]) if i not in matched]
    assert torch.equal(a[:, others], b[:, others])
    assert torch.allclose(log_magnitude(a[:, matched].reshape(-1, a.shape[2])),
                          b[:, matched].reshape(-1, a.shape[2]))


def test_candidate_bias_adds_a_first_order_logit_per_task(data):
    schema, batch = data
    model = _model(schema, candidate_bias=True)
    seen = {}
    model.interaction.register_forward_pre_hook(
        lambda mod, args: seen.__setitem__("candidate", args[0][:, 0].detach()))
    with_bias = model(batch)
    # The same model with the first-order weights at zero gives the interaction's logits alone.
    expected = model.candidate_bias(seen["candidate"])
    with torch.no_grad():
        model.candidate_bias.weight.zero_()
        model.candidate_bias.bias.zero_()
    without = model(batch)
    for i, task in enumerate(schema.tasks):
        assert torch.allclose(with_bias[task] - without[task], expected[:, i], atol=1e-6)
    assert model.candidate_bias in model.output_heads()  # kept in full precision by FP8


def test_esmm_and_cross_attention_say_what_they_need(data):
    schema, _ = data
    with pytest.raises(ValueError, match="esmm"):
        _model(attrs.evolve(schema, tasks=("click",)), multitask="esmm")
    with pytest.raises(ValueError, match="esmm_tasks"):
        _model(attrs.evolve(schema, tasks=("click", "purchase")), multitask="esmm")
    # Free task names: ESMM is configured by naming the parent and child tasks.
    renamed = attrs.evolve(schema, tasks=("click", "purchase"))
    _model(renamed, multitask="esmm", esmm_tasks=("click", "purchase"))
    # auto follows the data's tasks: ESMM where both tasks exist, independent heads elsewhere.
    assert _model(schema, multitask="auto").multitask == "esmm"
    single = _model(attrs.evolve(schema, tasks=("click",)), multitask="auto")
    assert single.multitask == "independent" and set(single.heads) == {"click"}
    assert _model(renamed, multitask="auto").multitask == "independent"
    context_tables = {f.table for f in schema.sparse_features}
    no_context = attrs.evolve(schema, sparse_features=(), num_dense=0,
                              tables=[t for t in schema.tables if t.name not in context_tables])
    with pytest.raises(ValueError, match="cross_attention"):
        _model(no_context, cross_attention=True)


def test_token_norm_puts_every_token_on_one_scale_and_keeps_sizes_within_a_token(data):
    """``token_norm = "batch"``: each token position is scaled by its own batch statistics, so
    a token summed over many events (target match, here without the log rescaling) no longer
    sets everyone's scale, and a sample's size relative to the batch survives."""
    schema, batch = data
    torch.manual_seed(0)
    model = _model(schema, token_norm="batch", target_match=8, attribute_attention=True,
                   match_token_scale="linear")
    seen = {}
    model.interaction.register_forward_pre_hook(lambda _, args: seen.update(tokens=args[0]))
    model.train()
    model(batch)
    tokens = seen["tokens"].detach().double()
    centred = tokens - tokens.mean(dim=(0, 2), keepdim=True)
    rms = centred.pow(2).mean(dim=(0, 2)).sqrt()
    # Every position at scale 1 (up to BatchNorm's eps against the smallest variances).
    assert torch.allclose(rms, torch.ones_like(rms), atol=5e-3)
    raw = {}
    model.token_norm.register_forward_pre_hook(lambda _, args: raw.update(tokens=args[0]))
    model(batch)
    unscaled = raw["tokens"].detach().double()
    spread = unscaled.pow(2).mean(dim=(0, 2)).sqrt()
    assert spread.max() > 10 * spread.min()  # they came on very different scales
    # Within a position, the samples keep their order of size (an affine map of each value).
    before = unscaled[:, 2].flatten()
    after = model.token_norm(raw["tokens"].detach())[:, 2].double().flatten()
    assert torch.corrcoef(torch.stack([before, after]))[0, 1] > 0.999999
    # Training forwards kept running statistics, which evaluation uses instead of the batch's.
    # Three updates (two forwards, one direct call) on the same tokens, momentum 0.1 each.
    assert model.token_norm.num_batches_tracked == 3
    expected = 0.9 ** 3 + (1 - 0.9 ** 3) * float(unscaled[:, spread.argmax()].var())
    assert float(model.token_norm.running_var.max()) == pytest.approx(expected, rel=0.2)


def test_token_norm_runs_on_one_rank_and_is_refused_on_several():
    from gem_core.config import ModelConfig
    from gem_core.errors import GemConfigError
    from gem_core.model.building import check_token_norm

    check_token_norm(ModelConfig(token_norm="batch"), world_size=1)
    check_token_norm(ModelConfig(), world_size=8)
    check_token_norm(ModelConfig(token_norm="sample"), world_size=8)  # no statistics to differ
    for kind in ("batch", "rms"):
        with pytest.raises(GemConfigError, match="differ between the 2 ranks"):
            check_token_norm(ModelConfig(token_norm=kind), world_size=2)
        with pytest.raises(GemConfigError, match="model.cross_branch_norm"):
            check_token_norm(ModelConfig(cross_branch=True, cross_branch_norm=kind), world_size=2)
    # A branch that is off does not run its norm.
    check_token_norm(ModelConfig(cross_branch_norm="batch"), world_size=2)
    check_token_norm(ModelConfig(cross_branch=True, cross_branch_norm="cap"), world_size=2)


def test_cross_branch_reads_its_own_scaling_beside_the_interaction(data):
    """``cross_branch``: the interaction reads the tokens as they come, the cross network beside
    it reads them through ``cross_branch_norm``, and each task's logit is its head's over the
    interaction plus the branch's head over the branch's output times its gate, which starts at
    zero (the model starts as the interaction alone)."""
    schema, batch = data
    model = _model(schema, interaction="wukong", cross_branch=True, cross_branch_norm="sample",
                   cross_branch_opening="gate", target_match=8, match_token_scale="linear",
                   candidate_bias=False)
    assert torch.equal(model.cross_branch.gate.detach(), torch.zeros(1))
    with torch.no_grad():
        model.cross_branch.gate.fill_(0.5)
    seen = {}
    model.interaction.register_forward_pre_hook(lambda _, a: seen.update(interaction=a[0]))
    model.cross_branch.network.register_forward_pre_hook(lambda _, a: seen.update(branch=a[0]))
    model.cross_branch.network.register_forward_hook(lambda _, a, out: seen.update(crossed=out))
    model.interaction.register_forward_hook(lambda _, a, out: seen.update(shared=out))
    model.train()
    logits = model(batch)
    raw, branch = seen["interaction"].detach(), seen["branch"].detach()
    torch.testing.assert_close(branch, model.cross_branch.norm(raw))
    rms = branch.pow(2).mean(dim=-1).sqrt()
    sized = raw.pow(2).mean(dim=-1) > 1e-3  # where eps (1e-5) is under 1 % of the mean square
    assert torch.allclose(rms[sized], torch.ones_like(rms[sized]), atol=5e-3)
    spread = raw.pow(2).mean(dim=(0, 2)).sqrt()
    assert spread.max() > 5 * spread.min()  # the interaction's tokens keep their own scales
    with torch.no_grad():
        expected = (model.heads["click"](seen["shared"])
                    + model.cross_branch.heads["click"](0.5 * seen["crossed"])).squeeze(-1)
    torch.testing.assert_close(logits["click"].detach(), expected)
    assert model.heads["click"].in_features == model.interaction.out_dim
    assert model.cross_branch.heads["click"].in_features == model.cross_branch.network.out_dim


@pytest.mark.parametrize("opening", ["gate", "heads"])
def test_cross_branch_leaves_the_rest_of_the_model_as_it_would_start_without(data, opening):
    """The branch is built from a random stream of its own: with it on, every other parameter
    starts exactly as without it (the same seed), the process's random stream is where it would
    be, and shut (a zero gate, or zero heads) the logits are the branch-less model's."""
    schema, batch = data
    options = dict(interaction="wukong", target_match=8, pma_queries=2)
    plain = _model(schema, **options)
    after_plain = torch.rand(4)
    branched = _model(schema, cross_branch=True, cross_branch_tokens="request", cross_rank=4,
                      cross_branch_opening=opening, **options)
    after_branched = torch.rand(4)
    assert torch.equal(after_plain, after_branched)
    plain_state, branched_state = plain.state_dict(), branched.state_dict()
    assert {k for k in branched_state if k not in plain_state} and all(
        k.startswith("cross_branch") for k in branched_state if k not in plain_state)
    for name, tensor in plain_state.items():
        assert torch.equal(branched_state[name], tensor), name
    plain.eval()
    branched.eval()
    with torch.no_grad():
        expected, got = plain(batch), branched(batch)
    for task in expected:
        torch.testing.assert_close(got[task], expected[task], rtol=0, atol=0)


def test_cross_branch_opens_through_its_heads_from_the_first_step_not_behind_a_gate(data):
    """Shut behind a zero gate, the first backward reaches only the gate (the heads' and the
    network's gradients are multiplied by it); shut by zero heads, the heads learn at once and
    the network waits for them; the network starts the same either way."""
    schema, batch = data
    grads = {}
    for opening in ("gate", "heads"):
        torch.manual_seed(0)
        model = _model(schema, interaction="wukong", cross_branch=True, cross_rank=4,
                       cross_branch_opening=opening)
        branch = model.cross_branch
        assert (branch.gate is None) == (opening == "heads")
        model.train()
        sum(logit.sum() for logit in model(batch).values()).backward()
        grads[opening] = {name: (param.grad is not None and bool(param.grad.abs().sum() > 0))
                          for name, param in branch.named_parameters()}
        grads[opening + " network"] = [p.detach().clone() for p in branch.network.parameters()]
    gate, heads = grads["gate"], grads["heads"]
    assert gate["gate"] and not any(v for k, v in gate.items() if k != "gate")
    assert all(v for k, v in heads.items() if k.startswith("heads."))
    assert not any(v for k, v in heads.items() if k.startswith("network."))
    for a, b in zip(grads["gate network"], grads["heads network"], strict=True):
        assert torch.equal(a, b)


def _branch_and_interaction_inputs(model):
    """A function of a batch: the tokens the interaction and the cross branch's network read
    (the model in evaluation, no gradients)."""
    seen = {}
    model.interaction.register_forward_pre_hook(lambda _, a: seen.update(interaction=a[0]))
    model.cross_branch.network.register_forward_pre_hook(lambda _, a: seen.update(branch=a[0]))
    model.eval()

    def inputs(batch):
        with torch.no_grad():
            model(batch)
        return seen["interaction"].clone(), seen["branch"].clone()

    return inputs


def test_cross_branch_on_request_tokens_reads_no_history(data):
    """``cross_branch_tokens = "request"``: the branch crosses the candidate's token and the
    request's own feature tokens only. Moving every event of the history further into the past
    changes the interaction's tokens (the history's summaries) and leaves the branch's input
    unchanged; changing the request's dense features changes it."""
    schema, batch = data
    torch.manual_seed(0)
    model = _model(schema, interaction="wukong", cross_branch=True, cross_branch_tokens="request",
                   cross_branch_norm="sample", cross_attention=False, target_match=8)
    assert len(model.cross_branch.positions) == 1 + model.num_context < model.num_tokens
    inputs = _branch_and_interaction_inputs(model)
    raw, branch = inputs(batch)
    positions = [0, *range(model.num_tokens - model.num_context, model.num_tokens)]
    torch.testing.assert_close(branch, model.cross_branch.norm(raw[:, positions]))
    older = attrs.evolve(batch, seq_timestamps=batch.seq_timestamps - 40 * 86_400)
    raw_older, branch_older = inputs(older)
    assert not torch.allclose(raw_older, raw)
    assert torch.equal(branch_older, branch)
    assert batch.dense is not None
    _, branch_dense = inputs(attrs.evolve(batch, dense=batch.dense * 3.0 + 1.0))
    assert not torch.allclose(branch_dense, branch)


@pytest.mark.parametrize("tokens", ["request", "all"])
def test_cross_branch_skip_leaves_a_request_feature_out_of_the_branch_only(data, tokens):
    """``cross_branch_skip``: the named sparse feature's token is not among the branch's
    inputs (other ids of that feature leave the branch's input as it was, while the
    interaction's changes), in both token choices; a name the data does not declare is
    refused with the names it does."""
    schema, batch = data
    torch.manual_seed(0)
    model = _model(schema, interaction="wukong", cross_branch=True, cross_branch_tokens=tokens,
                   cross_branch_skip=("user_segment",), cross_attention=False, target_match=8)
    skipped = model.num_tokens - model.num_context  # user_segment: the first context token
    kept = ([0, *range(skipped, model.num_tokens)] if tokens == "request"
            else list(range(model.num_tokens)))
    assert model.cross_branch.positions.tolist() == [p for p in kept if p != skipped]
    inputs = _branch_and_interaction_inputs(model)
    raw, branch = inputs(batch)
    segment = batch.sparse["user_segment"]
    other = attrs.evolve(batch, sparse={**batch.sparse, "user_segment": attrs.evolve(
        segment, values=(segment.values + 7) % 64)})
    raw_other, branch_other = inputs(other)
    assert not torch.allclose(raw_other, raw)
    if tokens == "request":  # the history's summaries never read the segment either
        assert torch.equal(branch_other, branch)
    with pytest.raises(ValueError, match=r"user_id.*\['user_segment', 'context'\]"):
        _model(schema, cross_branch=True, cross_branch_skip=("user_id",))


def test_cross_branch_max_rows_leaves_out_the_features_of_large_tables(data, caplog):
    """``cross_branch_max_rows``: the features whose table has more rows than the limit are
    left out as if named in ``cross_branch_skip`` (the same positions), and the start-up log
    says which; at or above the largest table nothing is left out."""
    schema, _ = data
    rows = {f.name: schema.table(f.table).num_embeddings for f in schema.sparse_features}
    assert rows["user_segment"] > rows["context"]
    options = dict(interaction="wukong", cross_branch=True, cross_branch_tokens="request")
    named = _model(schema, cross_branch_skip=("user_segment",), **options)
    with caplog.at_level(logging.INFO, logger="gem_core.model.cross_branch"):
        limited = _model(schema, cross_branch_max_rows=rows["context"], **options)
    assert torch.equal(limited.cross_branch.positions, named.cross_branch.positions)
    assert f"leaves out user_segment ({rows['user_segment']} rows)" in caplog.text
    whole = _model(schema, cross_branch_max_rows=rows["user_segment"], **options)
    assert len(whole.cross_branch.positions) == 1 + whole.num_context


def test_sample_token_norm_scales_each_token_of_each_sample_alone_in_float64():
    """``token_norm = "sample"``: every token of every sample over its own RMS times its
    position's gain; a zero token stays zero, and a sample scores the same alone as in a batch
    and in training as in evaluation (no statistics)."""
    from gem_core.model.token_norm import SampleTokenRMSNorm, token_norm

    torch.manual_seed(0)
    norm = token_norm("sample", 3).double()
    assert isinstance(norm, SampleTokenRMSNorm) and not list(norm.buffers())
    with torch.no_grad():
        norm.gain.copy_(torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64))
    tokens = torch.randn(16, 3, 4, dtype=torch.float64) * torch.tensor(
        [0.1, 6.0, 1.0], dtype=torch.float64).view(1, 3, 1)
    tokens[3, 1] = 0.0
    out = norm(tokens)
    for n in range(16):
        for k, gain in enumerate((0.5, 2.0, 1.0)):
            ms = tokens[n, k].pow(2).mean()
            assert torch.allclose(out[n, k], tokens[n, k] * gain / torch.sqrt(ms + 1e-5),
                                  rtol=1e-12, atol=0)
    assert torch.equal(out[3, 1], torch.zeros(4, dtype=torch.float64))
    norm.eval()
    assert torch.equal(norm(tokens[5:6]), out[5:6])
    with pytest.raises(ValueError, match="'sample'"):
        token_norm("layer", 3)


def test_cap_token_norm_brings_loud_tokens_under_one_and_leaves_quiet_ones_in_float64():
    """``token_norm = "cap"``: each token of each sample times ``1 / sqrt(1 + ms)``; a token of
    RMS 0.05 keeps 99.9 % of its size, one of RMS 20 comes out just under 1, sizes keep their
    order within a position, and zeros stay zero."""
    from gem_core.model.token_norm import SampleTokenCap, token_norm

    torch.manual_seed(0)
    cap = token_norm("cap", 3)
    assert isinstance(cap, SampleTokenCap) and not list(cap.parameters())
    tokens = torch.randn(32, 3, 8, dtype=torch.float64) * torch.tensor(
        [0.05, 20.0, 1.0], dtype=torch.float64).view(1, 3, 1)
    tokens[4, 2] = 0.0
    out = cap(tokens)
    ms = tokens.pow(2).mean(dim=-1, keepdim=True)
    torch.testing.assert_close(out, tokens / torch.sqrt(1.0 + ms), rtol=1e-12, atol=0)
    rms_in, rms_out = ms.squeeze(-1).sqrt(), out.pow(2).mean(dim=-1).sqrt()
    assert (rms_out[:, 0] / rms_in[:, 0]).min() > 0.99
    assert (rms_out[:, 1] < 1).all() and rms_out[:, 1].min() > 0.95
    assert torch.equal(rms_out[:, 1].argsort(), rms_in[:, 1].argsort())
    assert torch.equal(out[4, 2], torch.zeros(8, dtype=torch.float64))


def test_token_rms_norm_scales_each_position_by_its_rms_and_keeps_zeros_in_float64():
    from gem_core.model.token_norm import TokenRMSNorm

    torch.manual_seed(0)
    norm = TokenRMSNorm(3).double()
    with torch.no_grad():
        norm.gain.copy_(torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64))
    tokens = torch.randn(16, 3, 4, dtype=torch.float64) * torch.tensor(
        [0.1, 6.0, 1.0], dtype=torch.float64).view(1, 3, 1)
    tokens[3, 1] = 0.0  # a sample with no match: a zero token
    out = norm(tokens)
    for k, gain in enumerate((0.5, 2.0, 1.0)):
        ms = tokens[:, k].pow(2).mean()
        assert torch.allclose(out[:, k], tokens[:, k] * gain / torch.sqrt(ms + 1e-5),
                              rtol=1e-12, atol=0)
    assert torch.equal(out[3, 1], torch.zeros(4, dtype=torch.float64))
    # Running mean squares (momentum 0.1 from 1) are what evaluation divides by.
    expected = 0.9 + 0.1 * tokens.pow(2).mean(dim=(0, 2))
    assert torch.allclose(norm.running_ms, expected, rtol=1e-12, atol=0)
    norm.eval()
    assert torch.allclose(norm(tokens)[:, 1], tokens[:, 1] * 2.0 / torch.sqrt(expected[1] + 1e-5),
                          rtol=1e-12, atol=0)
