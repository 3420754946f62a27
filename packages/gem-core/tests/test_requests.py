"""Request-level samples: a request's history is encoded once and every candidate of the
request is scored from it exactly as if it were alone; multi-valued features, positions and the
schema's declared tables."""

import attrs
import pytest
import torch

from gem_core.batch import JaggedBatch
from gem_core.errors import GemDataError
from gem_core.jagged import Jagged
from gem_core.model.features import pool_rows
from gem_core.model.tokens import positions_from_end
from gem_core.schema import (
    ContextFeature,
    EmbeddingTable,
    FeatureSchema,
    SequenceFeature,
    schema_from_dict,
    schema_to_dict,
)
from gem_core.testing.models import small_model, synthetic_batch
from gem_core.train.loss import task_loss_sums


def one_candidate_per_request(batch: JaggedBatch) -> JaggedBatch:
    """The same impressions, each in a request of its own with a copy of its history."""
    owners = batch.candidate_rows()
    exploded = batch.select(owners)
    n = batch.num_candidates
    return attrs.evolve(exploded, candidate_offsets=torch.arange(n + 1),
                        candidate_ids=batch.candidate_ids, labels=batch.labels,
                        candidate_dense=batch.candidate_dense)


def as_double(batch: JaggedBatch) -> JaggedBatch:
    return attrs.evolve(batch, dense=batch.dense.double(), seq_dense=batch.seq_dense.double(),
                        candidate_dense=batch.candidate_dense.double())


@pytest.mark.parametrize("switches", [
    {},
    dict(pma_queries=2, target_queries="all", cross_attention=True, target_history=5),
    dict(pma_queries=2, interaction="wukong", multitask="esmm", downstream_history="events"),
])
def test_k_candidates_score_as_k_single_requests(switches):
    schema, batch = synthetic_batch(6, max_seq_len=30, seed=2, candidates=4)
    batch = as_double(batch)
    model = small_model(schema, **switches).double().eval()
    exploded = one_candidate_per_request(batch)
    seen = []
    model.tower.register_forward_hook(lambda module, args, out: seen.append(out.shape[0]))
    with torch.no_grad():
        grouped, alone = model(batch), model(exploded)
    for task in schema.tasks:
        assert grouped[task].shape == (batch.num_candidates,)
        torch.testing.assert_close(grouped[task], alone[task], rtol=1e-9, atol=1e-9)
    # The tower ran over each request's history once, not once per candidate.
    assert seen[0] == batch.num_events and seen[1] == 4 * batch.num_events


def test_loss_is_per_impression():
    schema, batch = synthetic_batch(5, max_seq_len=20, seed=4, candidates=3)
    model = small_model(schema)
    logits = model(batch)
    sums = task_loss_sums(logits, batch, schema.tasks)
    expected = torch.stack([torch.nn.functional.binary_cross_entropy_with_logits(
        logits[t], batch.labels[t], reduction="sum") for t in schema.tasks])
    torch.testing.assert_close(sums, expected)
    assert batch.labels["click"].shape == (15,)


def test_flops_count_impressions_above_the_tower():
    schema, batch = synthetic_batch(5, max_seq_len=20, seed=4, candidates=3)
    model = small_model(schema)
    lengths = batch.seq_lengths()
    one = model.flops_by_module(lengths)
    three = model.flops_by_module(lengths, batch.candidate_counts())
    assert three["tower.linear"] == one["tower.linear"]
    assert three["heads"] == 3 * one["heads"]
    assert three["interaction"] == 3 * one["interaction"]


def multi_valued_schema() -> FeatureSchema:
    return FeatureSchema(
        tables=[EmbeddingTable(name="movie", num_embeddings=50),
                EmbeddingTable(name="genre", num_embeddings=6),
                EmbeddingTable(name="ad", num_embeddings=1000, id_policy="hash"),
                EmbeddingTable(name="segment", num_embeddings=4)],
        event_features=[SequenceFeature(name="movie", table="movie"),
                        SequenceFeature(name="genres", table="genre", multi_valued=True),
                        SequenceFeature(name="ad", table="ad")],
        candidate_features=[SequenceFeature(name="movie", table="movie"),
                            SequenceFeature(name="genres", table="genre", multi_valued=True)],
        sparse_features=[ContextFeature(name="segment", table="segment")],
        tasks=("like",), max_seq_len=16)


def multi_valued_batch() -> JaggedBatch:
    g = torch.Generator().manual_seed(0)
    seq_offsets = torch.tensor([0, 3, 3, 7])
    genre_lengths = torch.tensor([1, 2, 3, 1, 2, 1, 1])
    genre_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), genre_lengths.cumsum(0)])
    cand_offsets = torch.tensor([0, 2, 3, 5])
    cand_genre_offsets = torch.tensor([0, 1, 3, 4, 5, 7])
    return JaggedBatch(
        seq_offsets=seq_offsets, seq_timestamps=torch.arange(7) * 10,
        event_ids={"movie": torch.randint(0, 50, (7,), generator=g),
                   "genres": Jagged(torch.randint(0, 6, (11,), generator=g), genre_offsets),
                   # raw 64-bit hashed ids, far above the table size
                   "ad": torch.tensor([(1 << 62) + i * 977 for i in range(7)])},
        request_timestamps=torch.tensor([100, 100, 100]),
        candidate_offsets=cand_offsets,
        candidate_ids={"movie": torch.randint(0, 50, (5,), generator=g),
                       "genres": Jagged(torch.randint(0, 6, (7,), generator=g),
                                        cand_genre_offsets)},
        labels={"like": torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])},
        sparse={"segment": Jagged(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2, 3]))},
        user_ids=torch.tensor([7, 8, 7]))


def test_multi_valued_features_and_hashed_ids_train_through_the_model():
    schema, batch = multi_valued_schema(), multi_valued_batch()
    batch.validate(schema)
    model = small_model(schema)
    logits = model(batch)["like"]
    assert logits.shape == (5,)
    logits.sum().backward()
    genre = model.embeddings.tables["genre"].weight.grad
    assert genre is not None and genre.abs().sum() > 0
    # The genre vectors of an event are pooled (mean), not summed.
    vectors = torch.randn(11, 3, dtype=torch.float64)
    offsets = batch.event_ids["genres"].offsets
    pooled = pool_rows(vectors, offsets, "mean")
    for e in range(7):
        torch.testing.assert_close(pooled[e], vectors[offsets[e]:offsets[e + 1]].mean(0))


def test_bad_request_level_input_is_named():
    schema, batch = multi_valued_schema(), multi_valued_batch()
    genres = batch.event_ids["genres"]
    empty = Jagged(genres.values, torch.tensor([0, 1, 1, 6, 7, 9, 10, 11]))
    with pytest.raises(GemDataError, match=r"row 0: event genres is empty for event 1 \(1 such"):
        attrs.evolve(batch, event_ids={**batch.event_ids, "genres": empty}).validate(schema)
    no_candidates = attrs.evolve(batch, candidate_offsets=torch.tensor([0, 2, 2, 5]))
    with pytest.raises(GemDataError, match=r"row 1: the request has no candidates"):
        no_candidates.validate(schema)
    short_labels = attrs.evolve(batch, labels={"like": torch.ones(4)})
    with pytest.raises(GemDataError, match=r"label 'like' missing or not of shape \(5,\)"):
        short_labels.validate(schema)
    out_of_range = dict(batch.candidate_ids)
    out_of_range["movie"] = out_of_range["movie"].clone()
    out_of_range["movie"][3] = 50
    with pytest.raises(GemDataError, match=r"row 2: candidate movie id 50 is outside \[0, 50\)"):
        attrs.evolve(batch, candidate_ids=out_of_range).validate(schema)


def test_schema_errors_name_the_table_and_feature():
    data = schema_to_dict(multi_valued_schema())
    assert schema_from_dict(data) == multi_valued_schema()
    data["event_features"][1]["table"] = "genre_typo"
    with pytest.raises(ValueError, match=r"event feature 'genres' names table 'genre_typo', "
                                         r"which is not declared"):
        schema_from_dict(data, "my.toml")
    data = schema_to_dict(multi_valued_schema())
    data["sparse_features"][0]["table"] = "movie"
    with pytest.raises(ValueError, match="context features are pooled"):
        schema_from_dict(data)
    data = schema_to_dict(multi_valued_schema())
    data["tables"][0]["id_policy"] = "crc"
    with pytest.raises(ValueError, match=r"my.toml: tables\[0\]"):
        schema_from_dict(data, "my.toml")
    data = schema_to_dict(multi_valued_schema())
    data["candidate_featurez"] = data.pop("candidate_features")
    with pytest.raises(ValueError, match="unknown field"):
        schema_from_dict(data)


def test_positions_from_end_count_back_from_the_latest_event():
    offsets = torch.tensor([0, 3, 3, 5])
    assert positions_from_end(offsets).tolist() == [2, 1, 0, 1, 0]


def test_relative_bias_learns_and_is_checked_at_start_up():
    from gem_core.attention.choice import check_attention_backend
    from gem_core.capabilities import RELATIVE_BIAS, SILU, SOFTMAX
    from gem_core.config import ModelConfig
    from gem_core.errors import GemConfigError
    from gem_core.registry import ImplementationSpec

    schema, batch = synthetic_batch(8, max_seq_len=30, seed=1, candidates=2)
    model = small_model(schema, relative_bias=True)
    model(batch)["click"].sum().backward()
    block = model.tower.blocks[0]
    assert block.position_bias.grad.abs().sum() > 0 and block.time_bias.grad.abs().sum() > 0

    # A backend that declares no optional capability is refused at start-up, by its
    # registration, before a model is built (the model itself no longer checks).
    undeclared = ImplementationSpec(name="undeclared", load=lambda: None,
                                    capabilities=frozenset({SOFTMAX, SILU}))
    declared = ImplementationSpec(name="declared", load=lambda: None,
                                  capabilities=frozenset({SOFTMAX, SILU, RELATIVE_BIAS}))
    config = ModelConfig(embedding_dim=16, relative_bias=True)
    with pytest.raises(GemConfigError, match="'undeclared' does not support relative_bias.*"
                                             "backends that do: declared"):
        check_attention_backend(config, undeclared, [undeclared, declared])
    check_attention_backend(config, declared, [undeclared, declared])


def test_target_match_sums_the_recent_events_sharing_an_attribute():
    from gem_core.model.target_match import TargetMatch, shared_attributes

    schema, batch = multi_valued_schema(), multi_valued_batch()
    # movie is shared and single-valued, genres multi-valued (matched by overlap: see
    # test_target_match.py); only movie is compared here.
    assert shared_attributes(schema) == [("movie", "movie"), ("genres", "genres")]
    movies = batch.event_ids["movie"].clone()
    candidates = batch.candidate_ids["movie"].clone()
    movies[:] = torch.tensor([5, 6, 5, 1, 2, 3, 2])   # requests: [5 6 5], [], [1 2 3 2]
    candidates[:] = torch.tensor([5, 9, 4, 2, 1])     # owners: 0 0 1 2 2
    torch.manual_seed(0)
    match = TargetMatch(4, [("movie", "movie")], window=3).double()
    history = torch.randn(7, 4, dtype=torch.float64)
    owner = batch.candidate_rows()
    out = match(history, batch.seq_offsets, owner, {"movie": candidates},
                {"movie": movies})[:, 0]
    values = match.values(history)
    expected = torch.stack([
        values[0] + values[2],           # 5 among [5 6 5]
        torch.zeros(4, dtype=torch.float64),  # 9: no match
        torch.zeros(4, dtype=torch.float64),  # empty history
        values[6] + values[4],           # 2 among the last 3 of [1 2 3 2]
        torch.zeros(4, dtype=torch.float64),  # 1 is the 4th most recent: outside the window
    ])
    torch.testing.assert_close(out, match.proj(expected))
    no_shared = attrs.evolve(schema, event_features=[SequenceFeature(name="ad", table="ad")])
    with pytest.raises(ValueError, match="share a table"):
        small_model(no_shared, target_match=4)
