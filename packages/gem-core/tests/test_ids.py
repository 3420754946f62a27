"""Id policies: splitmix64 in int64 arithmetic equals the uint64 definition computed with Python
integers, the unsigned modulo is exact over the whole 64-bit range, and collisions are counted."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gem_core.ids import collision_report, map_ids, splitmix64, unsigned_mod
from gem_core.schema import EmbeddingTable

MASK = (1 << 64) - 1


def splitmix64_python(x: int) -> int:
    """The textbook uint64 splitmix64 finalizer, with Python's unbounded integers."""
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def as_signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


int64s = st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1)


@settings(max_examples=200, deadline=None)
@given(st.lists(int64s, min_size=1, max_size=50), st.integers(1, (1 << 40)))
def test_hash_policy_equals_the_uint64_definition(values, size):
    ids = torch.tensor(values, dtype=torch.int64)
    mixed = splitmix64(ids).tolist()
    expected = [splitmix64_python(v & MASK) for v in values]
    assert [m & MASK for m in mixed] == expected
    table = EmbeddingTable(name="t", num_embeddings=size, id_policy="hash")
    rows = map_ids(ids, table).tolist()
    assert rows == [e % size for e in expected]
    assert all(0 <= r < size for r in rows)


@settings(max_examples=200, deadline=None)
@given(st.lists(int64s, min_size=1, max_size=50), st.integers(1, (1 << 61)))
def test_unsigned_modulo_is_exact_on_the_whole_range(values, size):
    got = unsigned_mod(torch.tensor(values, dtype=torch.int64), size).tolist()
    assert got == [(v & MASK) % size for v in values]


def test_ids_above_two_to_the_62_map_stably_and_spread():
    raw = torch.tensor([(1 << 62) + 5, (1 << 63) - 1, as_signed((1 << 64) - 3), -1, 0])
    table = EmbeddingTable(name="ads", num_embeddings=1000, id_policy="hash")
    first, second = map_ids(raw, table), map_ids(raw.clone(), table)
    assert torch.equal(first, second)
    assert ((first >= 0) & (first < 1000)).all()
    assert len(set(first.tolist())) == 5
    dense = EmbeddingTable(name="d", num_embeddings=10)
    assert map_ids(raw, dense) is raw  # dense ids are validated elsewhere, never changed


def test_modulo_policy_and_collision_report():
    table = EmbeddingTable(name="m", num_embeddings=7, id_policy="modulo")
    assert map_ids(torch.tensor([0, 7, 15, -1]), table).tolist() == [0, 0, 1, MASK % 7]
    report = collision_report(np.array([1, 8, 8, 2, 3]), table)
    # distinct 1, 2, 3, 8; 1 and 8 share row 1
    assert report == {"distinct_ids": 4, "rows_used": 3, "colliding_ids": 2,
                      "collision_rate": 0.5}
    hashed = EmbeddingTable(name="h", num_embeddings=1 << 20, id_policy="hash")
    ids = np.random.default_rng(0).integers(-(1 << 63), (1 << 63) - 1, 10_000, dtype=np.int64)
    rate = collision_report(ids, hashed)["collision_rate"]
    # Birthday bound: about n / table_size of the ids share a row.
    assert rate == pytest.approx(10_000 / (1 << 20), rel=0.5)
