"""JaggedBatch <-> TorchRec KeyedJaggedTensor, and the checks TorchRec itself does not make."""

from __future__ import annotations

import pytest
import torch

from gem_core.errors import GemDataError
from gem_core.jagged import Jagged
from gem_core.model.features import FeatureLookup
from gem_data.kjt import from_kjt, kjt_keys, to_kjt

torchrec = pytest.importorskip("torchrec")
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402


@pytest.fixture(scope="module")
def sample(schema, make_chunk):
    return schema, make_chunk(37, seed=11)


def test_keys_and_rows_follow_the_feature_lookup(sample):
    schema, batch = sample
    assert kjt_keys(schema) == ["event.item", "event.action", "event.genres", "event.ad_id",
                                "candidate.item", "candidate.advertiser", "candidate.category",
                                "candidate.genres", "candidate.ad_id", "segment", "context"]
    kjt, _ = to_kjt(batch, schema)
    assert kjt.keys() == kjt_keys(schema)
    assert kjt.stride() == batch.batch_size  # one row per request for every key
    features = kjt.to_dict()
    inputs = FeatureLookup(schema).inputs(batch)
    assert set(inputs) == set(kjt.keys())
    for key, jagged in inputs.items():
        assert torch.equal(features[key].values(), jagged.values), key
        assert torch.equal(features[key].offsets(), jagged.offsets), key
    # Hashed ids are mapped to rows of their table.
    assert int(features["event.ad_id"].values().max()) < 1000
    assert torch.equal(features["event.item"].offsets(), batch.seq_offsets)


@pytest.mark.parametrize("map_ids", [False, True])
def test_round_trip(sample, map_ids):
    schema, batch = sample
    kjt, extras = to_kjt(batch, schema, map_ids=map_ids)
    back = from_kjt(kjt, extras, schema)
    back.validate(schema)
    for field in ("seq_offsets", "seq_timestamps", "candidate_offsets", "request_timestamps",
                  "dense", "user_ids"):
        assert torch.equal(getattr(back, field), getattr(batch, field)), field
    assert torch.equal(back.event_ids["item"], batch.event_ids["item"])  # dense policy
    genres = back.event_ids["genres"]
    assert isinstance(genres, Jagged)
    assert torch.equal(genres.offsets, batch.event_ids["genres"].offsets)
    assert torch.equal(genres.values, batch.event_ids["genres"].values)
    for name, bag in batch.sparse.items():
        assert torch.equal(back.sparse[name].offsets, bag.offsets)
    if not map_ids:
        assert torch.equal(back.event_ids["ad_id"], batch.event_ids["ad_id"])
        assert torch.equal(back.sparse["context"].values, batch.sparse["context"].values)
    assert torch.equal(back.labels["click"], batch.labels["click"])


def _rebuild(kjt, lengths=None, values=None, offsets=None):
    if offsets is not None:
        return KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), offsets=offsets)
    return KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values() if values is None else values,
                             lengths=kjt.lengths() if lengths is None else lengths)


def test_negative_length_rejected(sample):
    schema, batch = sample
    kjt, extras = to_kjt(batch, schema)
    lengths = kjt.lengths().clone()
    b = batch.batch_size
    key = kjt_keys(schema).index("context")
    lengths[key * b + 4] -= 2
    lengths[key * b + 5] += 2
    with pytest.raises(GemDataError, match=r"feature 'context' row 4: length -1 is negative"):
        from_kjt(_rebuild(kjt, lengths=lengths), extras, schema)


def test_backward_offsets_rejected(sample):
    schema, batch = sample
    kjt, extras = to_kjt(batch, schema)
    offsets = kjt.offsets().clone()
    offsets[3] = offsets[5] + 1
    with pytest.raises(GemDataError, match="offsets go backwards"):
        from_kjt(_rebuild(kjt, offsets=offsets), extras, schema)


def test_lengths_must_match_keys_and_values(sample):
    schema, batch = sample
    kjt, extras = to_kjt(batch, schema)
    with pytest.raises(GemDataError, match="lengths for"):
        from_kjt(_rebuild(kjt, lengths=kjt.lengths()[:-1]), extras, schema)
    lengths = kjt.lengths().clone()
    lengths[0] += 1
    with pytest.raises(GemDataError, match="lengths sum to"):
        from_kjt(_rebuild(kjt, lengths=lengths), extras, schema)


@pytest.mark.parametrize("key, what", [("event.action", "history length"),
                                       ("event.genres", "history length"),
                                       ("candidate.advertiser", "candidate count")])
def test_per_request_lengths_must_agree(sample, key, what):
    schema, batch = sample
    kjt, extras = to_kjt(batch, schema)
    lengths = kjt.lengths().clone()
    b = batch.batch_size
    index = kjt_keys(schema).index(key)
    row = int(torch.nonzero(batch.seq_lengths() > 0)[0])
    lengths[index * b + row] -= 1        # one shorter on `row` ...
    lengths[index * b + row + 1] += 1    # ... and one longer on the next, same total
    with pytest.raises(GemDataError, match=rf"'{key}' row {row}: length .* {what}"):
        from_kjt(_rebuild(kjt, lengths=lengths), extras, schema)
