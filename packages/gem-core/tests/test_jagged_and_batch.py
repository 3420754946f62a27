import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gem_core.config import DataConfig
from gem_core.errors import GemDataError
from gem_core.jagged import Jagged, check_offsets, offsets_from_lengths
from gem_core.plugins import build_plugins


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(0, 6), min_size=1, max_size=8), data=st.data())
def test_select_matches_python_slicing(lengths, data):
    offsets = offsets_from_lengths(torch.tensor(lengths))
    values = torch.arange(int(offsets[-1])) * 10 + 1
    jagged = Jagged(values, offsets)
    indices = data.draw(st.lists(st.integers(0, len(lengths) - 1), max_size=10))
    picked = jagged.select(torch.tensor(indices, dtype=torch.int64))
    expected = [values[offsets[i]:offsets[i + 1]].tolist() for i in indices]
    got = [picked.values[picked.offsets[j]:picked.offsets[j + 1]].tolist()
           for j in range(len(indices))]
    assert got == expected


def test_to_padded_keeps_rows_and_pads():
    jagged = Jagged(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 3, 3, 4]))
    assert jagged.to_padded().tolist() == [[1, 2, 3], [0, 0, 0], [4, 0, 0]]


@pytest.mark.parametrize("offsets, total, message", [
    ([1, 2], 2, "must start at 0"),
    ([0, 3, 2], 2, "offsets decrease at row 1"),
    ([0, 2], 3, "offsets end at 2 but there are 3 values"),
])
def test_bad_offsets_are_rejected(offsets, total, message):
    with pytest.raises(ValueError, match=message):
        check_offsets(torch.tensor(offsets), total, "feature x")


@pytest.fixture(scope="module")
def source():
    data = DataConfig(max_seq_len=32, eval_rows=64, options={"num_items": 300, "num_users": 50})
    return build_plugins().data_source(data, seed=3)


def test_synthetic_batches_are_valid_and_deterministic(source):
    a = source.generate(64, split=1, index=5)
    b = source.generate(64, split=1, index=5)
    a.validate(source.schema)
    assert torch.equal(a.event_ids["item"], b.event_ids["item"])
    assert torch.equal(a.labels["click"], b.labels["click"])
    assert int(a.seq_lengths().max()) <= 32
    c = source.generate(64, split=1, index=6)
    assert not torch.equal(a.candidate_ids["item"], c.candidate_ids["item"])


def test_batch_select_keeps_every_field_aligned(source):
    batch = source.generate(16, split=1, index=0)
    picked = batch.select(torch.tensor([3, 0, 3]))
    assert picked.batch_size == 3
    for new, old in enumerate([3, 0, 3]):
        start, end = batch.seq_offsets[old], batch.seq_offsets[old + 1]
        n_start, n_end = picked.seq_offsets[new], picked.seq_offsets[new + 1]
        assert torch.equal(picked.event_ids["item"][n_start:n_end],
                           batch.event_ids["item"][start:end])
        assert picked.candidate_ids["item"][new] == batch.candidate_ids["item"][old]
        assert torch.equal(picked.dense[new], batch.dense[old])
    picked.validate(source.schema)


def test_validate_names_row_feature_and_value(source):
    batch = source.generate(8, split=1, index=0)
    bad_ids = batch.candidate_ids["item"].clone()
    bad_ids[5] = 10**6
    broken = attrs.evolve(batch, candidate_ids={**batch.candidate_ids, "item": bad_ids})
    with pytest.raises(GemDataError, match=r"row 5: candidate item id 1000000 is outside "
                                           r"\[0, 300\) of table 'item'"):
        broken.validate(source.schema, where="unit")
    labels = dict(batch.labels)
    labels["click"] = labels["click"].clone()
    labels["click"][2] = 0.5
    with pytest.raises(GemDataError, match=r"row 2: label 'click' = 0.5, expected 0 or 1"):
        attrs.evolve(batch, labels=labels).validate(source.schema)
    dense = batch.dense.clone()
    dense[1, 3] = float("nan")
    with pytest.raises(GemDataError, match=r"row 1: dense feature 3 = nan is not finite"):
        attrs.evolve(batch, dense=dense).validate(source.schema)


def test_synthetic_options_are_validated():
    from gem_core.errors import GemConfigError

    with pytest.raises(GemConfigError, match="unknown key 'data.options.num_itemz'"):
        build_plugins().data_source(DataConfig(options={"num_itemz": 5}), seed=0)
