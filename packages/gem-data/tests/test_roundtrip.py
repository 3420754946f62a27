"""Batch -> Parquet (format 2) -> batch gives back the same arrays; truncation; uint64 ids."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from gem_core.errors import GemDataError
from gem_core.jagged import Jagged
from gem_data import format as fmt
from gem_data.arrow_io import batch_to_table, table_to_batch, truncate_recent
from gem_data.batch_ops import RowGather, concat_batches, events_before, slice_batch
from gem_data.bench import make_requests
from gem_data.dataset import DatasetReader, split_units
from gem_data.loader import ParquetStream
from gem_data.manifest import read_manifest, with_digests, write_manifest


@pytest.fixture(autouse=True)
def _names(schema, make_chunk, data_options):
    global SCHEMA, chunk, OPTIONS
    SCHEMA, chunk, OPTIONS = schema, make_chunk, data_options


def _same_ids(a, b) -> bool:
    if isinstance(a, Jagged) or isinstance(b, Jagged):
        return (isinstance(a, Jagged) and isinstance(b, Jagged) and torch.equal(a.values, b.values)
                and torch.equal(a.offsets, b.offsets))
    return torch.equal(a, b)


def assert_batches_equal(a, b) -> None:
    for field in ("seq_offsets", "seq_timestamps", "request_timestamps", "candidate_offsets",
                  "dense", "seq_dense", "candidate_dense", "user_ids"):
        x, y = getattr(a, field), getattr(b, field)
        assert (x is None and y is None) or torch.equal(x, y), field
    for store in ("event_ids", "candidate_ids"):
        sa, sb = getattr(a, store), getattr(b, store)
        assert sa.keys() == sb.keys(), store
        for k in sa:
            assert _same_ids(sa[k], sb[k]), (store, k)
    assert a.labels.keys() == b.labels.keys()
    for k in a.labels:
        assert torch.equal(a.labels[k], b.labels[k]), k
    for k in a.sparse:
        assert _same_ids(a.sparse[k], b.sparse[k]), k


def test_table_round_trip_every_kind_of_feature():
    batch = chunk(60)
    batch.validate(SCHEMA)
    table = batch_to_table(batch, SCHEMA)
    assert table.schema.equals(fmt.arrow_schema(SCHEMA))
    back = table_to_batch(table, SCHEMA)
    assert_batches_equal(back, batch)
    back.validate(SCHEMA)
    # A sliced table (offsets not starting at 0) converts the same.
    assert_batches_equal(table_to_batch(table.slice(10, 5), SCHEMA),
                         batch.select(torch.arange(10, 15)))
    # So does a table of several chunks.
    two = pa.concat_tables([table.slice(0, 20), table.slice(20)])
    assert_batches_equal(table_to_batch(two, SCHEMA), batch)


def test_column_types():
    schema = fmt.arrow_schema(SCHEMA)
    ids = pa.list_(pa.int64())
    assert schema.field("user_id").type == pa.int64()
    assert schema.field("event.item").type == ids
    assert schema.field("event.genres").type == pa.list_(ids)
    assert schema.field("candidate.genres").type == pa.list_(ids)
    assert schema.field("label.click").type == pa.list_(pa.float32())
    assert schema.field("candidate_dense").type == pa.list_(pa.float32())
    assert schema.field("dense").type == pa.list_(pa.float32(), 4)


def test_parquet_round_trip_through_the_loader(small_dataset):
    expected = concat_batches([
        make_requests(SCHEMA, 256 if i < 11 else 3000 - 11 * 256, seed=7, index=i, **OPTIONS)
        for i in range(12)])
    reader = DatasetReader(small_dataset)
    stream = ParquetStream(reader, split_units(reader.manifest, "train"), batch_size=3000,
                           seed=0, shuffle=False, epochs=1)
    batches = list(stream)
    assert len(batches) == 1
    assert_batches_equal(batches[0], expected)
    batches[0].validate(reader.schema)


def test_manifest(small_dataset):
    manifest = read_manifest(small_dataset)
    assert manifest.rows("train") == 3000 and manifest.rows("eval") == 500
    assert manifest.splits["train"][0].row_groups[:2] == (256, 256)
    assert manifest.schema == SCHEMA
    chunks = [make_requests(SCHEMA, min(256, 3000 - s), seed=7, index=i, **OPTIONS)
              for i, s in enumerate(range(0, 3000, 256))]
    assert manifest.tokens("train") == sum(c.num_events for c in chunks)
    assert manifest.candidates("train") == sum(c.num_candidates for c in chunks)
    data = json.loads((small_dataset / "manifest.json").read_text())
    assert data["format_version"] == 2 and data["schema"]["tables"][0]["name"] == "item"


def test_truncation_keeps_most_recent_events():
    offsets = np.array([0, 5, 5, 7])
    new_offsets, keep = truncate_recent(offsets, 3)
    assert new_offsets.tolist() == [0, 3, 3, 5]
    assert keep.tolist() == [2, 3, 4, 5, 6]
    assert truncate_recent(offsets, 5)[1] is None


def test_truncation_cuts_every_event_feature_alike():
    batch = chunk(40)
    table = batch_to_table(batch, SCHEMA)
    short = table_to_batch(table, SCHEMA, max_seq_len=4)
    short.validate(SCHEMA)
    assert int(short.seq_lengths().max()) == 4
    lengths = batch.seq_lengths()
    for row in range(40):
        n = int(lengths[row])
        kept = min(n, 4)
        end = int(batch.seq_offsets[row + 1])
        s0, s1 = int(short.seq_offsets[row]), int(short.seq_offsets[row + 1])
        assert s1 - s0 == kept
        events = torch.arange(end - kept, end)
        mine = torch.arange(s0, s1)
        assert torch.equal(short.seq_timestamps[mine], batch.seq_timestamps[events])
        assert torch.equal(short.event_ids["item"][mine], batch.event_ids["item"][events])
        assert torch.equal(short.seq_dense[mine], batch.seq_dense[events])
        genres_short = short.event_ids["genres"].select(mine)
        genres_full = batch.event_ids["genres"].select(events)
        assert torch.equal(genres_short.values, genres_full.values)
        assert torch.equal(genres_short.offsets, genres_full.offsets)


def test_uint64_id_columns_read_as_int64_bits(make_dataset):
    directory = make_dataset()
    path = directory / "train-00000.parquet"
    table = pq.read_table(path)
    expected = table_to_batch(table, SCHEMA)
    # Rewrite the hashed ad ids (some with the top bit set) and the user ids as uint64.
    for name in ("event.ad_id", "candidate.ad_id", "user_id", "event.genres"):
        column = table.column(name)
        target = fmt.with_leaf(column.type, pa.uint64())
        index = table.schema.get_field_index(name)
        table = table.set_column(index, pa.field(name, target, nullable=False),
                                 pa.chunked_array([c.view(target) for c in column.chunks]))
    assert table.schema.field("event.ad_id").type == pa.list_(pa.uint64())
    assert bool((expected.event_ids["ad_id"] < 0).any())  # bit patterns above 2^63 are there
    pq.write_table(table, path, row_group_size=32)
    write_manifest(directory, with_digests(directory, read_manifest(directory)))  # rewritten
    reader = DatasetReader(directory)
    got = concat_batches([table_to_batch(reader.read(u), SCHEMA)
                          for u in split_units(reader.manifest, "train")])
    assert_batches_equal(got, expected)


def test_batch_without_user_ids_is_refused():
    import attrs

    with pytest.raises(GemDataError, match="user id per request"):
        batch_to_table(attrs.evolve(chunk(4), user_ids=None), SCHEMA)


def test_slice_gather_concat_and_events_before():
    batch = chunk(30)
    assert_batches_equal(concat_batches([slice_batch(batch, 0, 11), slice_batch(batch, 11, 30)]),
                         batch)
    order = np.random.default_rng(0).permutation(30)
    assert_batches_equal(RowGather(batch).take(order), batch.select(torch.from_numpy(order)))
    cutoff = batch.request_timestamps - 3600
    cut = events_before(batch, cutoff)
    cut.validate(SCHEMA)
    rows = torch.repeat_interleave(torch.arange(30), cut.seq_lengths())
    assert bool((cut.seq_timestamps <= cutoff[rows]).all())
    keep = batch.seq_timestamps <= cutoff[torch.repeat_interleave(torch.arange(30),
                                                                   batch.seq_lengths())]
    index = torch.nonzero(keep).flatten()
    assert torch.equal(cut.event_ids["genres"].values,
                       batch.event_ids["genres"].select(index).values)


def _write_v1(directory):
    """A small format 1 data set (one row per impression), as gem-data 1 wrote it."""
    directory.mkdir()
    rng = np.random.default_rng(0)
    n = 50
    lengths = rng.integers(0, 6, n)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    e = int(offsets[-1])
    request = 1_700_000_000 + np.arange(n, dtype=np.int64) * 100
    stamps = np.repeat(request, lengths) - np.arange(e, 0, -1)
    lst = lambda v, o=offsets: pa.ListArray.from_arrays(pa.array(o), pa.array(v))  # noqa: E731
    table = pa.table({
        "history_item_id": lst(rng.integers(0, 100, e)),
        "history_action": lst(rng.integers(0, 3, e)),
        "history_timestamp": lst(stamps.astype(np.int64)),
        "request_timestamp": pa.array(request),
        "candidate_item_id": pa.array(rng.integers(0, 100, n)),
        "candidate.advertiser": pa.array(rng.integers(0, 10, n)),
        "sparse.segment": lst(rng.integers(0, 8, n), np.arange(n + 1, dtype=np.int32)),
        "dense": pa.FixedSizeListArray.from_arrays(
            pa.array(rng.standard_normal(2 * n).astype(np.float32)), 2),
        "label.click": pa.array(rng.integers(0, 2, n).astype(np.float32)),
    })
    pq.write_table(table.slice(0, 40), directory / "train-00000.parquet", row_group_size=20)
    pq.write_table(table.slice(40), directory / "eval-00000.parquet")
    manifest = {
        "format_version": 1,
        "schema": {"num_items": 100, "num_actions": 3,
                   "sparse_features": [{"name": "segment", "num_embeddings": 8,
                                        "pooling": "sum"}],
                   "candidate_features": [{"name": "advertiser", "num_embeddings": 10,
                                           "pooling": "sum"}],
                   "num_dense": 2, "seq_dense_dim": 0, "tasks": ["click"], "max_seq_len": 8,
                   "candidate_content": False, "user_embedding_dim": 0},
        "splits": {"train": {"rows": 40, "files": [
                       {"path": "train-00000.parquet", "rows": 40, "row_groups": [20, 20]}]},
                   "eval": {"rows": 10, "files": [
                       {"path": "eval-00000.parquet", "rows": 10, "row_groups": [10]}]}},
        "info": {"source": "test"},
    }
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return table


def test_convert_format_1(tmp_path):
    from click.testing import CliRunner

    from gem_data.cli import data_group

    old = tmp_path / "old"
    table = _write_v1(old)
    with pytest.raises(GemDataError, match=rf"gem data convert {old} --out"):
        DatasetReader(old)
    result = CliRunner().invoke(data_group, ["convert", str(old), "--out", str(tmp_path / "new")])
    assert result.exit_code == 0, result.output
    reader = DatasetReader(tmp_path / "new")
    schema = reader.schema
    assert [f.name for f in schema.event_features] == ["item", "action"]
    assert [f.name for f in schema.candidate_features] == ["item", "advertiser"]
    assert reader.manifest.splits["train"][0].row_groups == (20, 20)
    batches = [table_to_batch(reader.read(u), schema)
               for split in ("train", "eval") for u in split_units(reader.manifest, split)]
    batch = concat_batches(batches)
    batch.validate(schema)
    assert torch.equal(batch.candidate_offsets, torch.arange(51))
    assert torch.equal(batch.event_ids["item"], torch.tensor(
        table.column("history_item_id").combine_chunks().values.to_numpy()))
    assert torch.equal(batch.candidate_ids["advertiser"],
                       torch.tensor(table.column("candidate.advertiser").to_numpy()))
    assert torch.equal(batch.labels["click"],
                       torch.tensor(table.column("label.click").to_numpy()))
    assert batch.user_ids.tolist() == list(range(50))
    again = CliRunner().invoke(data_group, ["convert", str(tmp_path / "new"), "--out",
                                            str(tmp_path / "x")])
    assert again.exit_code != 0 and "already format 2" in again.output
