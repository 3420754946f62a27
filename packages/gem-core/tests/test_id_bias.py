"""``model.id_bias``: per-id logit offsets of candidate features, stepped by SGD at a rate per
impression (gem_core.model.id_bias, gem_core.train.table_optimizer)."""

import attrs
import numpy as np
import pytest
import torch

from gem_core.config import TrainConfig
from gem_core.config.model_schema import ModelConfig
from gem_core.errors import GemConfigError
from gem_core.model.id_bias import IdBias, id_bias_parameters
from gem_core.registry import ImplementationSpec
from gem_core.schema import EmbeddingTable
from gem_core.testing.models import small_model, synthetic_batch
from gem_core.train.loss import task_loss_sums
from gem_core.train.optim import make_optimizer
from gem_core.train.table_optimizer import check_id_bias_stepper, set_step_impressions

FEATURES = ("item", "advertiser")


@pytest.fixture(scope="module")
def data():
    return synthetic_batch(16, max_seq_len=24, seed=3, candidates=3)


def _train_step(model, optimizer, batch, tasks) -> dict[str, torch.Tensor]:
    """One trainer-like step (mean loss over the batch's impressions, the impressions told to
    the offsets' group); the probabilities the step's forward gave."""
    optimizer.zero_grad()
    logits = model(batch)
    probabilities = {t: torch.sigmoid(logits[t]).detach() for t in tasks}
    loss = task_loss_sums(logits, batch, tasks).sum() / batch.num_candidates
    loss.backward()
    set_step_impressions(optimizer, batch.num_candidates)
    optimizer.step()
    return probabilities


def _summed_residuals(probabilities, batch, tasks, ids, rows) -> np.ndarray:
    """Each row's ``sum(p - y)`` per task over the batch's impressions of its id, in float64."""
    residual = np.zeros((rows, len(tasks)))
    for task_index, task in enumerate(tasks):
        p = probabilities[task].numpy().astype(np.float64)
        np.add.at(residual[:, task_index], ids, p - batch.labels[task].numpy().astype(np.float64))
    return residual


def test_one_step_moves_each_offset_by_rate_times_clicks_minus_p_over_its_impressions(data):
    """The trainer's loss is the mean over the step's impressions; with the step's impressions
    given, the offsets' group steps ``rate * sum(y - p)`` over each id's impressions, per task:
    checked against that sum computed in float64 from the model's own probabilities. Ids share rows
    here (several impressions of one item in the batch), so the sum is a real sum."""
    schema, batch = data
    rate = 0.37
    model = small_model(schema, id_bias=FEATURES, dropout=0.0).train()
    optimizer = make_optimizer(TrainConfig(), id_bias_rate=rate, id_bias_step="constant")(model)
    probabilities = _train_step(model, optimizer, batch, schema.tasks)
    items = batch.candidate_ids["item"].numpy()
    assert len(set(items)) < items.size, "the test needs an id seen twice in the batch"
    for name in FEATURES:
        expected = -rate * _summed_residuals(probabilities, batch, schema.tasks,
                                             batch.candidate_ids[name].numpy(),
                                             schema.table(name).num_embeddings)
        got = model.id_bias.offsets[name].detach().numpy()
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    assert np.abs(expected).max() > 0.05  # not a test on zeros


def test_fisher_steps_shrink_as_an_id_is_seen_by_its_summed_squared_residuals(data):
    """``fisher``: over two steps on the same batch, each offset keeps ``F``, the sum of its
    per-step ``sum(p - y)`` squared, and steps ``-sum(p - y) / (1 / rate + F)``: checked against
    float64 arithmetic on the model's probabilities at each step; the second step of an id seen
    in both is smaller than a constant step at ``rate`` would be."""
    schema, batch = data
    rate = 0.5
    model = small_model(schema, id_bias=("item",), dropout=0.0).train()
    optimizer = make_optimizer(TrainConfig(lr=1e-12), id_bias_rate=rate,
                               id_bias_step="fisher")(model)
    ids = batch.candidate_ids["item"].numpy()
    rows = schema.table("item").num_embeddings
    expected = np.zeros((rows, len(schema.tasks)))
    information = np.zeros_like(expected)
    for _ in range(2):
        probabilities = _train_step(model, optimizer, batch, schema.tasks)
        residual = _summed_residuals(probabilities, batch, schema.tasks, ids, rows)
        information += residual ** 2
        step = residual / (1 / rate + information)
        expected -= step
        got = model.id_bias.offsets["item"].detach().numpy()
        np.testing.assert_allclose(got, expected, rtol=0, atol=2e-6)
    seen = np.unique(ids)
    assert (np.abs(step[seen]) < rate * np.abs(residual[seen]) - 1e-6).all()
    assert np.abs(expected).max() > 0.05
    state = optimizer.state[model.id_bias.offsets["item"]]
    np.testing.assert_allclose(state["fisher"].numpy(), information, rtol=1e-5, atol=1e-7)


def test_without_the_impressions_the_step_is_rate_times_the_mean_gradient(data):
    """A caller that does not say how many impressions its loss averages (a benchmark) steps
    at ``rate`` on the loss as it is: ``impressions`` starts at 1."""
    schema, batch = data
    model = small_model(schema, id_bias=("item",), dropout=0.0).train()
    optimizer = make_optimizer(TrainConfig(), id_bias_rate=0.5, id_bias_step="constant")(model)
    loss = task_loss_sums(model(batch), batch, schema.tasks).sum() / batch.num_candidates
    loss.backward()
    (offsets,) = id_bias_parameters(model)
    gradient = offsets.grad.clone()
    optimizer.step()
    torch.testing.assert_close(offsets.detach(), -0.5 * gradient, rtol=0, atol=0)
    assert gradient.abs().max() > 0


def test_a_model_with_offsets_starts_as_the_model_without_them(data):
    """Offsets start at 0 and their making draws nothing: every other parameter and every
    logit is what the model without them has, in training and in evaluation."""
    schema, batch = data
    plain = small_model(schema)
    biased = small_model(schema, id_bias=FEATURES)
    plain_state = plain.state_dict()
    for key, value in biased.state_dict().items():
        if key.startswith("id_bias."):
            assert not value.any()
        else:
            assert torch.equal(value, plain_state[key]), key
    for mode in (False, True):
        plain.train(mode)
        biased.train(mode)
        torch.manual_seed(1)
        want = plain(batch)
        torch.manual_seed(1)
        got = biased(batch)
        for task in schema.tasks:
            assert torch.equal(got[task], want[task])


def test_the_offsets_are_their_own_group_and_not_in_adamw(data):
    """AdamW never sees the offsets (no moments, no weight decay), and the rest of the model's
    groups are what they are without them."""
    schema, _ = data
    model = small_model(schema, id_bias=FEATURES)
    optimizer = make_optimizer(TrainConfig(weight_decay=0.1), id_bias_rate=0.25,
                               id_bias_step="fisher")(model)
    offsets = {id(p) for p in id_bias_parameters(model)}
    assert len(offsets) == 2
    own = [g for g in optimizer.param_groups if g.get("per_impression")]
    assert len(own) == 1 and {id(p) for p in own[0]["params"]} == offsets
    assert own[0]["table_optimizer"] == "sgd" and own[0]["table_lr"] == 0.25
    others = [g for g in optimizer.param_groups if not g.get("per_impression")]
    assert not offsets & {id(p) for g in others for p in g["params"]}
    with pytest.raises(ValueError, match="id_bias_rate"):
        make_optimizer(TrainConfig())(model)
    with pytest.raises(ValueError, match="id_bias_step"):
        make_optimizer(TrainConfig(), id_bias_rate=0.25)(model)


def test_the_offsets_read_the_rows_their_table_maps_raw_ids_to(data):
    """A hashed table's raw ids reach their offsets through the table's own map."""
    schema, batch = data
    hashed = attrs.evolve(schema, tables=tuple(
        attrs.evolve(t, id_policy="hash", num_embeddings=97) if t.name == "item" else t
        for t in schema.tables))
    module = IdBias(["item"], hashed, num_tasks=2)
    from gem_core.ids import map_ids

    rows = map_ids(batch.candidate_ids["item"], hashed.table("item"))
    with torch.no_grad():
        module.offsets["item"].copy_(torch.arange(97 * 2, dtype=torch.float32).view(97, 2))
    torch.testing.assert_close(module(batch), module.offsets["item"].detach()[rows])


def test_refused_features_name_what_is_wrong(data):
    schema, _ = data
    with pytest.raises(ValueError, match=r"\[.nothing.\].*candidate features"):
        IdBias(["nothing"], schema, num_tasks=2)
    with pytest.raises(ValueError, match="twice"):
        IdBias(["item", "item"], schema, num_tasks=2)
    managed = attrs.evolve(schema, tables=tuple(
        attrs.evolve(t, id_policy="managed", num_embeddings=64) if t.name == "item" else t
        for t in schema.tables))
    with pytest.raises(ValueError, match="managed"):
        IdBias(["item"], managed, num_tasks=2)
    multi = attrs.evolve(schema, candidate_features=tuple(
        attrs.evolve(f, multi_valued=True) if f.name == "category" else f
        for f in schema.candidate_features))
    with pytest.raises(ValueError, match="multi-valued"):
        IdBias(["category"], multi, num_tasks=2)
    assert isinstance(schema.table("item"), EmbeddingTable)


def test_a_dense_sharding_without_the_table_optimizer_capability_is_refused():
    from gem_core.plugins import build_plugins

    plugins = build_plugins()
    flattening = ImplementationSpec(name="flattens", load=object)
    with pytest.raises(GemConfigError, match="model.id_bias.*'flattens'"):
        check_id_bias_stepper(ModelConfig(id_bias=("item",)), dense_sharding=flattening,
                              plugins=plugins)
    check_id_bias_stepper(ModelConfig(), dense_sharding=flattening, plugins=plugins)


def test_a_learned_prior_without_the_fisher_step_is_refused(data):
    from gem_core.plugins import build_plugins

    plugins = build_plugins()
    dense = plugins.registry("dense_sharding").get("none")
    config = ModelConfig(id_bias=("item",), id_bias_prior="learned", id_bias_step="constant")
    with pytest.raises(GemConfigError, match="id_bias_prior = 'learned'.*'constant'"):
        check_id_bias_stepper(config, dense_sharding=dense, plugins=plugins)
    check_id_bias_stepper(attrs.evolve(config, id_bias_step="fisher"), dense_sharding=dense,
                          plugins=plugins)
    with pytest.raises(ValueError, match="learned"):
        make_optimizer(TrainConfig(), id_bias_rate=0.5, id_bias_step="constant",
                       id_bias_prior="learned")(small_model(data[0], id_bias=("item",)))


def test_a_learned_prior_is_the_mean_of_the_seen_offsets_posterior_second_moments(data):
    """``id_bias_prior = "learned"``: after each step the prior variance (per task) becomes the
    mean over the ids seen so far of ``b^2 + 1 / (1 / prior + F)``, and the next step divides by
    ``1 / prior + F`` with that prior: checked over three steps against float64 arithmetic on
    the model's own probabilities; the prior moved away from the rate it started at."""
    schema, batch = data
    rate = 0.5
    model = small_model(schema, id_bias=("item",), dropout=0.0).train()
    optimizer = make_optimizer(TrainConfig(lr=1e-12), id_bias_rate=rate, id_bias_step="fisher",
                               id_bias_prior="learned")(model)
    ids = batch.candidate_ids["item"].numpy()
    rows, tasks = schema.table("item").num_embeddings, len(schema.tasks)
    expected, information = np.zeros((rows, tasks)), np.zeros((rows, tasks))
    prior = np.full(tasks, rate)
    for _ in range(3):
        probabilities = _train_step(model, optimizer, batch, schema.tasks)
        residual = _summed_residuals(probabilities, batch, schema.tasks, ids, rows)
        information += residual ** 2
        expected -= residual / (1 / prior + information)
        seen = information > 0
        second_moments = expected ** 2 + 1 / (1 / prior + information)
        prior = np.where(seen, second_moments, 0).sum(0) / seen.sum(0)
        got = model.id_bias.offsets["item"].detach().numpy()
        np.testing.assert_allclose(got, expected, rtol=0, atol=2e-6)
        state = optimizer.state[model.id_bias.offsets["item"]]
        np.testing.assert_allclose(state["prior"].numpy(), prior, rtol=1e-5)
    assert np.abs(prior - rate).min() > 0.01 and np.abs(expected).max() > 0.05
    # unseen rows are not in the mean: the batch holds few of the table's ids
    assert 0 < seen[:, 0].sum() < rows / 2


def test_id_bias_only_leaves_the_features_out_of_the_tokens_and_unread_tables_unbuilt(data):
    """``id_bias_only``: the advertiser (a candidate feature no event shares) reaches the model
    through its offsets alone: its table is not built, and with the offsets at 0 the logits do
    not depend on the candidates' advertiser ids; the item, whose table the history reads too,
    keeps its table for the events."""
    from gem_core.model.id_bias import model_schema

    schema, batch = data
    config_options = dict(id_bias=("advertiser", "item"), id_bias_only=True)
    model = small_model(schema, **config_options).eval()
    embedded = model_schema(model.config, schema)
    assert [f.name for f in embedded.candidate_features] == ["category"]
    assert {t.name for t in embedded.tables} == {t.name for t in schema.tables} - {"advertiser"}
    built = {key.split(".")[2] for key in model.state_dict() if key.startswith("embeddings.")}
    assert built == {t.name for t in embedded.tables}
    assert model.schema is schema and model.embedded_schema == embedded
    other = attrs.evolve(batch, candidate_ids={
        **batch.candidate_ids, "advertiser": (batch.candidate_ids["advertiser"] + 1) % 100,
        "item": (batch.candidate_ids["item"] + 7) % 2000})
    with torch.no_grad():
        same, moved = model(batch), model(other)
        for task in schema.tasks:
            assert torch.equal(same[task], moved[task])
        model.id_bias.offsets["advertiser"].normal_()
        changed = model(other)
    assert not torch.equal(changed[schema.tasks[0]], same[schema.tasks[0]])


def test_id_bias_only_refuses_what_would_leave_nothing_or_names_nothing(data):
    schema, _ = data
    with pytest.raises(ValueError, match="names none"):
        small_model(schema, id_bias_only=True)
    with pytest.raises(ValueError, match="no embedded feature"):
        small_model(schema, id_bias=("item", "advertiser", "category"), id_bias_only=True)


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_a_request_features_offsets_step_by_rate_times_clicks_minus_p_over_its_impressions(
        data, pooling):
    """A sparse (request) feature's offsets reach every impression of the request, its bag of
    ids pooled as the feature declares: one step moves an id's offset by ``rate * w * sum(y - p)``
    over the impressions of the requests whose bag holds it (``w`` 1 for ``sum``, one over the
    bag's size for ``mean``), checked in float64 beside a candidate feature's offsets."""
    schema, batch = data
    schema = attrs.evolve(schema, sparse_features=tuple(
        attrs.evolve(f, pooling=pooling) for f in schema.sparse_features))
    rate = 0.29
    model = small_model(schema, id_bias=("user_segment", "item"), dropout=0.0).train()
    optimizer = make_optimizer(TrainConfig(), id_bias_rate=rate, id_bias_step="constant")(model)
    probabilities = _train_step(model, optimizer, batch, schema.tasks)
    bag = batch.sparse["user_segment"]
    values, offsets = bag.values.numpy(), bag.offsets.numpy()
    assert (np.diff(offsets) > 1).any(), "the test needs bags of several ids"
    request = batch.candidate_rows().numpy()
    expected = np.zeros((schema.table("user_segment").num_embeddings, len(schema.tasks)))
    for task_index, task in enumerate(schema.tasks):
        residual = (batch.labels[task].numpy().astype(np.float64)
                    - probabilities[task].numpy().astype(np.float64))
        for impression, row in enumerate(request):
            ids = values[offsets[row]:offsets[row + 1]]
            weight = 1.0 if pooling == "sum" else 1.0 / ids.size
            np.add.at(expected[:, task_index], ids, rate * weight * residual[impression])
    got = model.id_bias.offsets["user_segment"].detach().numpy()
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    assert np.abs(expected).max() > 0.05
    assert model.id_bias.offsets["item"].detach().abs().max() > 0


def test_a_request_feature_through_its_offsets_alone_and_names_with_their_kind(data):
    """``id_bias_only`` takes a request's feature out of the context tokens (its table unbuilt,
    the logits blind to its ids until its offsets move); a name the data declares both as a
    candidate and a sparse feature must say which, and an unknown kind is refused."""
    from gem_core.model.id_bias import check_id_bias_features, model_schema
    from gem_core.schema import ContextFeature

    schema, batch = data
    model = small_model(schema, id_bias=("user_segment",), id_bias_only=True).eval()
    embedded = model_schema(model.config, schema)
    assert [f.name for f in embedded.sparse_features] == ["context"]
    assert "user_segment" not in {t.name for t in embedded.tables}
    bag = batch.sparse["user_segment"]
    other = attrs.evolve(batch, sparse={**batch.sparse, "user_segment": type(bag)(
        (bag.values + 5) % 64, bag.offsets)})
    with torch.no_grad():
        same, moved = model(batch), model(other)
        assert all(torch.equal(same[t], moved[t]) for t in schema.tasks)
        model.id_bias.offsets["user_segment"].normal_()
        assert not torch.equal(model(other)[schema.tasks[0]], same[schema.tasks[0]])
    both = attrs.evolve(schema, sparse_features=(
        *schema.sparse_features, ContextFeature(name="item", table="context")))
    with pytest.raises(ValueError, match="both.*'candidate.item' or 'sparse.item'"):
        check_id_bias_features(["item"], both)
    resolved = check_id_bias_features(["candidate.item", "sparse.item"], both)
    assert [(f.kind, f.key) for f in resolved] == [("candidate", "candidate__item"),
                                                   ("sparse", "sparse__item")]
    with pytest.raises(ValueError, match="'candidate' or 'sparse', not 'event'"):
        check_id_bias_features(["event.item"], both)
    with pytest.raises(ValueError, match="twice"):
        check_id_bias_features(["item", "candidate.item"], schema)


def test_gradient_clipping_leaves_the_offsets_gradients_as_they_are(data):
    """``train.grad_clip`` scales the rest of the model's gradients, not the offsets': their
    step is set per impression. The norm it returns is that of the clipped parameters."""
    from gem_core.engine import Engine, clipped_parameters

    schema, batch = data
    model = small_model(schema, id_bias=("item",), dropout=0.0).train()
    optimizer = make_optimizer(TrainConfig(), id_bias_rate=0.25, id_bias_step="fisher")(model)
    loss = task_loss_sums(model(batch), batch, schema.tasks).sum() / batch.num_candidates
    (loss * 1000).backward()  # gradients far above the clip
    (offsets,) = id_bias_parameters(model)
    before = offsets.grad.clone()
    others = clipped_parameters(model, optimizer)
    assert others and all(p is not offsets for p in others)
    norm = Engine(model, optimizer).clip_grad_norm(1.0)
    assert float(norm) > 10
    assert torch.equal(offsets.grad, before) and before.abs().max() > 0
    clipped = torch.nn.utils.get_total_norm([p.grad for p in others])
    assert float(clipped) == pytest.approx(1.0, rel=1e-4)
