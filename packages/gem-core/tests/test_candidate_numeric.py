"""A candidate's numeric features (``FeatureSchema.candidate_numeric_dim``,
``JaggedBatch.candidate_numeric``): declared apart from the history's content width, checked
by ``validate`` (naming the row), kept by ``select``, passed to exported programs, and projected
into the candidate's token by a Linear whose FLOPs the analytic count has (FlopCounterMode
agrees), after the signed log of ``model.numeric_scale``."""

from __future__ import annotations

import attrs
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from gem_core.errors import GemDataError
from gem_core.schema import schema_from_dict, schema_to_dict
from gem_core.serving.inputs import CANDIDATES, CONTEXT, HISTORY, batch_from_inputs, batch_inputs
from gem_core.testing.models import small_model, synthetic_batch

WIDTH = 3


@pytest.fixture(scope="module")
def data():
    schema, batch = synthetic_batch(6, max_seq_len=40, seed=1, candidates=3)
    numeric = torch.randn(batch.num_candidates, WIDTH, generator=torch.Generator().manual_seed(0))
    return (attrs.evolve(schema, candidate_numeric_dim=WIDTH),
            attrs.evolve(batch, candidate_numeric=numeric))


def test_the_schema_declares_its_width_and_reads_as_before_without_it(data):
    schema, _ = data
    assert schema_to_dict(schema)["candidate_numeric_dim"] == WIDTH
    assert schema_from_dict(schema_to_dict(schema)) == schema
    # Written only where a data set has them: other schemas (and their digests) are unchanged.
    assert "candidate_numeric_dim" not in schema_to_dict(attrs.evolve(schema,
                                                                      candidate_numeric_dim=0))


def test_validate_checks_shape_and_names_the_row_of_a_non_finite_value(data):
    schema, batch = data
    batch.validate(schema)
    with pytest.raises(GemDataError, match=r"candidate numeric features must be \(18, 3\)"):
        attrs.evolve(batch, candidate_numeric=None).validate(schema)
    bad = batch.candidate_numeric.clone()
    bad[7, 2] = float("nan")  # candidate 7 is request 2's (3 candidates each)
    with pytest.raises(GemDataError, match=r"row 2: candidate 7's numeric feature 2 = nan is "
                                           r"not finite"):
        attrs.evolve(batch, candidate_numeric=bad).validate(schema)
    picked = batch.select(torch.tensor([4, 1]))
    assert torch.equal(picked.candidate_numeric,
                       batch.candidate_numeric[torch.tensor([12, 13, 14, 3, 4, 5])])


def test_exported_programs_take_them_as_an_input(data):
    schema, batch = data
    groups = (HISTORY, CANDIDATES, CONTEXT)
    inputs = batch_inputs(batch, schema, groups)
    assert torch.equal(inputs["candidate_numeric"], batch.candidate_numeric)
    assert torch.equal(batch_from_inputs(inputs, schema, groups).candidate_numeric,
                       batch.candidate_numeric)


def test_the_projection_joins_the_candidate_token_and_its_flops_are_counted(data):
    schema, batch = data
    model = small_model(schema, pma_queries=2, target_match=8, action_feature="action")
    with FlopCounterMode(display=False) as counter:
        logits = model(batch)
    counts = model.flops_by_module(batch.seq_lengths(), batch.candidate_counts(), dense=True)
    measured = counter.get_flop_counts()["GEMModel.candidate_numeric"]
    assert counts["candidate_numeric"] == sum(measured.values())
    assert sum(counts.values()) == pytest.approx(counter.get_total_flops(), rel=0.01)
    with torch.no_grad():
        moved = model(attrs.evolve(batch, candidate_numeric=batch.candidate_numeric + 1))
    assert not torch.allclose(logits["click"], moved["click"])
    # Without the width, no projection and the FLOPs of before.
    plain = small_model(attrs.evolve(schema, candidate_numeric_dim=0), pma_queries=2)
    assert plain.candidate_numeric is None
    assert "candidate_numeric" not in plain.flops_by_module(batch.seq_lengths())


@pytest.mark.parametrize("kind", ["log", "none"])
def test_numbers_reach_their_projections_as_numeric_scale_reads_them(data, kind):
    """``model.numeric_scale``: the candidate's numeric features and the request's dense ones
    enter their projections as ``sign(x) log(1 + |x|)`` (``log``, checked against float64
    arithmetic) or as they are (``none``)."""
    schema, batch = data
    assert schema.num_dense > 0
    raw = attrs.evolve(batch, candidate_numeric=batch.candidate_numeric * 1000.0,
                       dense=batch.dense * 1000.0)
    model = small_model(schema, numeric_scale=kind)
    seen = {}
    model.candidate_numeric.register_forward_pre_hook(lambda _, a: seen.update(numeric=a[0]))
    model.dense_proj.register_forward_pre_hook(lambda _, a: seen.update(dense=a[0]))
    with torch.no_grad():
        model(raw)
    for name, values in (("numeric", raw.candidate_numeric), ("dense", raw.dense)):
        x = values.double()
        expected = x.sign() * (1 + x.abs()).log() if kind == "log" else x
        torch.testing.assert_close(seen[name].double(), expected, rtol=1e-6, atol=1e-6)
        assert (values.abs() > 100).any()  # large values, where the two kinds differ


def test_a_raw_price_does_not_blow_up_the_first_gradients(data):
    """Prices in the thousands, projected as they are and read by the candidate bias (a
    linear read of the candidate's token, as in the presets), give a first loss and gradients
    tens of times those of the same model reading them through the signed log."""
    schema, batch = data
    prices = torch.rand(batch.num_candidates, WIDTH, generator=torch.Generator().manual_seed(1))
    priced = attrs.evolve(batch, candidate_numeric=(prices * 8).exp())  # 1 to about 3,000

    def gradient_norm(kind: str) -> float:
        model = small_model(schema, numeric_scale=kind, candidate_bias=True)
        logits = model(priced)["click"]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            logits, priced.labels["click"].float())
        loss.backward()
        losses[kind] = float(loss.detach())
        return float(torch.cat([p.grad.flatten() for p in model.parameters()
                                if p.grad is not None]).norm())

    losses = {}
    assert gradient_norm("none") > 20 * gradient_norm("log")
    assert losses["none"] > 20 * losses["log"]
