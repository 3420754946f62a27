"""JaggedBatch <-> TorchRec KeyedJaggedTensor, and the checks TorchRec itself does not make."""

from __future__ import annotations

import pytest
import torch

from gem_core.errors import GemDataError
from gem_data.generator import AdsLogGenerator
from gem_data.kjt import KJTExtras, from_kjt, kjt_keys, to_kjt

torchrec = pytest.importorskip("torchrec")
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402


@pytest.fixture(scope="module")
def sample(small_options):
    generator = AdsLogGenerator(small_options, seed=11)
    return generator.schema, generator.chunk(37, split="train", index=0)


def test_round_trip(sample):
    schema, batch = sample
    kjt, extras = to_kjt(batch, schema)
    assert kjt.keys() == kjt_keys(schema)
    features = kjt.to_dict()
    assert torch.equal(features["history_item_id"].values(), batch.seq_item_ids)
    assert torch.equal(features["history_item_id"].offsets(), batch.seq_offsets)
    assert torch.equal(features["sparse.user_segment"].values(),
                       batch.sparse["user_segment"].values)
    back = from_kjt(kjt, extras, schema)
    for field in ("seq_offsets", "seq_item_ids", "seq_action_ids", "seq_timestamps",
                  "candidate_item_ids", "request_timestamps", "dense"):
        assert torch.equal(getattr(back, field), getattr(batch, field)), field
    for name, bag in batch.sparse.items():
        assert torch.equal(back.sparse[name].offsets, bag.offsets)
    assert torch.equal(back.candidate_sparse["advertiser"], batch.candidate_sparse["advertiser"])
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
    # Shift one event from row 4 to row 5 of sparse.context: row 4 gets length -1... keep the sum.
    key = kjt_keys(schema).index("sparse.context")
    lengths[key * b + 4] -= 2
    lengths[key * b + 5] += 2
    with pytest.raises(GemDataError, match=r"feature 'sparse.context' row 4: length -1 is negative"):
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
    short = KJTExtras(request_timestamps=batch.request_timestamps[:-1], labels=batch.labels)
    with pytest.raises(GemDataError):
        from_kjt(kjt, short, schema)


def test_history_keys_must_agree(sample):
    schema, batch = sample
    kjt, extras = to_kjt(batch, schema)
    lengths = kjt.lengths().clone()
    b = batch.batch_size
    row = int(torch.nonzero(batch.seq_lengths() > 0)[0])
    lengths[b + row] -= 1        # history_action one shorter on `row` ...
    lengths[b + row + 1] += 1    # ... and one longer on the next, same total
    with pytest.raises(GemDataError, match=rf"'history_action' row {row}: length"):
        from_kjt(_rebuild(kjt, lengths=lengths), extras, schema)
