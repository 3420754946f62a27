"""The mixture-of-experts layer: reference and grouped paths against a float64 reference,
capacity and its overflow policy, the load-balancing loss and the FLOP count."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from gem_core.model.moe import MixtureOfExperts, auxiliary_losses, step_stats, summarize_step_stats
from gem_core.model.moe_router import expert_capacity


def _layer(kind="swiglu", *, d=12, hidden=20, out=None, experts=5, top_k=2, capacity=0.0,
           shared=False, impl="reference", seed=0) -> MixtureOfExperts:
    torch.manual_seed(seed)
    return MixtureOfExperts(kind, d, hidden, out or d, num_experts=experts, top_k=top_k,
                            capacity_factor=capacity, shared_expert=shared, aux_loss_weight=0.01,
                            impl=impl)


def _silence_expert(layer: MixtureOfExperts, e: int) -> None:
    """Inputs are made positive; a strongly negative router row then never wins."""
    with torch.no_grad():
        layer.router.weight[e] = -5.0


def _run(layer: MixtureOfExperts, x: torch.Tensor, grad_out: torch.Tensor):
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = layer(x)
    (out * grad_out).sum().backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p))
             for n, p in layer.named_parameters()}
    return out.detach(), x.grad, grads


CASES = [  # kind, tokens, d, hidden, out, experts, top_k, shared, capacity
    ("swiglu", 37, 12, 20, 12, 5, 2, False, 0.0),
    ("swiglu", 64, 8, 16, 8, 8, 1, True, 0.0),
    ("mlp", 23, 18, 10, 6, 4, 2, True, 0.0),
    ("mlp", 50, 7, 9, 14, 6, 3, False, 0.0),
    ("swiglu", 40, 10, 12, 10, 4, 2, True, 0.75),  # drops assignments
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-E{c[5]}-k{c[6]}-cf{c[8]}" for c in CASES])
def test_reference_and_grouped_match_float64(case):
    kind, tokens, d, hidden, out, experts, top_k, shared, capacity = case
    reference64 = _layer(kind, d=d, hidden=hidden, out=out, experts=experts, top_k=top_k,
                         capacity=capacity, shared=shared).double()
    _silence_expert(reference64, experts - 1)  # an expert that gets zero tokens
    torch.manual_seed(1)
    x = torch.rand(tokens, d, dtype=torch.float64) + 0.05
    grad_out = torch.randn(tokens, out, dtype=torch.float64)
    want_out, want_x, want_w = _run(reference64, x, grad_out)
    assert reference64.last_stats["tokens"][experts - 1] == 0
    assert want_w["experts." + ("gate" if kind == "swiglu" else "w_in")][experts - 1].abs() \
        .sum() == 0

    grouped64 = copy.deepcopy(reference64)
    grouped64.impl = "grouped"
    got_out, got_x, got_w = _run(grouped64, x, grad_out)
    assert grouped64.experts.last_grouped_backend == "padded_bmm"  # no float64 grouped_mm
    torch.testing.assert_close(got_out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_x, want_x, rtol=1e-12, atol=1e-12)
    for name, grad in want_w.items():
        torch.testing.assert_close(got_w[name], grad, rtol=1e-12, atol=1e-12, msg=name)

    for impl in ("reference", "grouped"):
        layer32 = copy.deepcopy(reference64).float()
        layer32.impl = impl
        got_out, got_x, got_w = _run(layer32, x.float(), grad_out.float())
        torch.testing.assert_close(got_out.double(), want_out, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got_x.double(), want_x, rtol=1e-4, atol=1e-5)
        for name, grad in want_w.items():
            torch.testing.assert_close(got_w[name].double(), grad, rtol=1e-4, atol=1e-5,
                                       msg=f"{impl} {name}")
        assert torch.equal(layer32.last_stats["tokens"], reference64.last_stats["tokens"])
        if impl == "grouped":  # torch._grouped_mm needs 16-byte aligned fp32 rows
            aligned = all(width % 4 == 0 for width in (d, hidden, out))
            assert layer32.experts.last_grouped_backend == ("grouped_mm" if aligned
                                                            else "padded_bmm")


def test_capacity_drops_overflow_in_priority_order_and_counts_them():
    layer = _layer(experts=4, top_k=1, capacity=1.0, shared=True)
    with torch.no_grad():  # every token prefers expert 0
        layer.router.weight.zero_()
        layer.router.weight[0] = 1.0
    x = torch.rand(10, 12) + 0.1
    out = layer(x)
    capacity = expert_capacity(10, 1, 4, 1.0)
    assert capacity == 3
    assert layer.last_stats["tokens"].tolist() == [10, 0, 0, 0]
    assert int(layer.last_stats["dropped"]) == 10 - capacity
    # The first `capacity` tokens are kept; the rest get the shared expert only.
    shared_only = layer.shared.one(0, x)
    torch.testing.assert_close(out[capacity:], shared_only[capacity:])
    assert not torch.allclose(out[:capacity], shared_only[:capacity])
    # No limit: nothing dropped.
    assert expert_capacity(10, 2, 4, 0.0) == 20


def test_second_choices_are_dropped_before_first_choices():
    layer = _layer(experts=2, top_k=2, capacity=0.5)  # capacity ceil(0.5 * 6 * 2 / 2) = 3
    x = torch.rand(6, 12) + 0.1
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0] = 1.0  # expert 0 first for everyone, expert 1 second
    routing = layer.router(x)
    first, second = routing.kept[:6], routing.kept[6:]
    assert first.tolist() == [True] * 3 + [False] * 3
    assert second.tolist() == [True] * 3 + [False] * 3


def test_load_balancing_loss_is_one_when_uniform_and_trains_the_router():
    layer = _layer(experts=4, top_k=1)
    with torch.no_grad():
        layer.router.weight.zero_()  # uniform probabilities
    x = torch.rand(8, 12)
    layer(x)
    # Uniform probs: P_e = 1/4; f sums to 1 whatever top-1 ties pick: E * sum f/E = 1.
    assert float(layer.last_aux_loss.detach()) == pytest.approx(0.01 * 1.0)
    skewed = _layer(experts=4, top_k=2)
    skewed(torch.rand(32, 12))
    loss = auxiliary_losses(skewed)["moe.load_balance"]
    assert float(loss.detach()) > 0.01
    loss.backward()
    assert skewed.router.weight.grad.abs().sum() > 0
    assert skewed.experts.gate.grad is None  # the loss reaches only the router


def test_evaluation_records_nothing_and_stats_summarise():
    layer = _layer(experts=3, top_k=1)
    layer.eval()
    layer(torch.rand(5, 12))
    assert layer.last_aux_loss is None and not layer.last_stats
    layer.train()
    layer(torch.rand(9, 12))
    stats = step_stats(layer)
    assert sum(v for k, v in stats.items() if ".tokens." in k) == 9
    summary = summarize_step_stats({"moe.a.tokens.0": 6.0, "moe.a.tokens.1": 2.0,
                                    "moe.a.dropped": 1.0, "moe.b.tokens.0": 4.0,
                                    "moe.b.tokens.1": 4.0, "moe.b.dropped": 0.0})
    assert summary["moe_tokens_per_expert"] == {"a": [6.0, 2.0], "b": [4.0, 4.0]}
    assert summary["moe_load_max_over_mean"] == {"a": 1.5, "b": 1.0}
    assert summary["moe_load_max_over_mean_worst"] == 1.5
    assert summary["moe_dropped_tokens"] == 1.0
    assert summarize_step_stats({}) == {}


@pytest.mark.parametrize("kind, shared", [("swiglu", False), ("mlp", True)])
def test_flops_count_active_experts_only(kind, shared):
    layer = _layer(kind, experts=6, top_k=2, shared=shared, out=9)
    x = torch.rand(31, 12)
    with FlopCounterMode(display=False) as counter:
        layer(x)
    assert layer.flops(31) == counter.get_total_flops()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="top_k must be between 1 and num_experts"):
        _layer(experts=2, top_k=3)
    with pytest.raises(ValueError, match="impl must be one of reference, grouped"):
        _layer(impl="fast")
    with pytest.raises(ValueError, match="expert kind must be one of"):
        _layer(kind="gelu")


def test_grouped_path_follows_autocast_like_the_reference():
    """torch._grouped_mm is not an autocast op; the grouped path casts to the autocast dtype
    itself, so bf16 inputs and fp32 weights work and both paths compute the same bf16 math."""
    reference = _layer(d=32, hidden=64, experts=4, top_k=2, shared=True)
    grouped = copy.deepcopy(reference)
    grouped.impl = "grouped"
    x = torch.randn(40, 32)
    outputs = []
    for layer in (reference, grouped):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            rows = torch.nn.functional.linear(x, torch.eye(32))  # bf16 rows, as in a model
            out = layer(rows)
        out.float().sum().backward()
        assert out.dtype == torch.bfloat16
        assert layer.experts.gate.grad.dtype == torch.float32
        outputs.append(out.float())
    assert grouped.experts.last_grouped_backend == "grouped_mm"
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("impl", ["reference", "grouped"])
def test_activation_checkpointing_recomputes_the_same_layer(impl):
    """The first forward probes torch._grouped_mm (its own small backward); the recomputation
    does not, and the checkpoint must still see the same saved tensors."""
    from torch.utils.checkpoint import checkpoint

    plain = _layer(d=16, hidden=32, experts=4, impl=impl)
    recomputed = copy.deepcopy(plain)
    x = torch.randn(30, 16)
    want = _run(plain, x, torch.ones(30, 16))
    recomputed.zero_grad(set_to_none=True)
    x2 = x.clone().requires_grad_(True)
    checkpoint(recomputed, x2, use_reentrant=False).sum().backward()
    torch.testing.assert_close(x2.grad, want[1])
    for name, param in recomputed.named_parameters():
        torch.testing.assert_close(param.grad, want[2][name], msg=name)
