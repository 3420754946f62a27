"""Synthetic -> Parquet -> batch gives back the generator's arrays; the generator's properties."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from gem_data.arrow_io import batch_to_table, table_to_batch, truncate_recent
from gem_data.batch_ops import concat_batches
from gem_data.dataset import DatasetReader, split_units
from gem_data.generator import AdsLogGenerator, SynthOptions
from gem_data.loader import ParquetStream
from gem_data.manifest import read_manifest


def assert_batches_equal(a, b) -> None:
    for field in ("seq_offsets", "seq_item_ids", "seq_action_ids", "seq_timestamps",
                  "request_timestamps", "candidate_item_ids", "dense"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert a.labels.keys() == b.labels.keys()
    for k in a.labels:
        assert torch.equal(a.labels[k], b.labels[k]), k
    for k in a.sparse:
        assert torch.equal(a.sparse[k].values, b.sparse[k].values), k
        assert torch.equal(a.sparse[k].offsets, b.sparse[k].offsets), k
    for k in a.candidate_sparse:
        assert torch.equal(a.candidate_sparse[k], b.candidate_sparse[k]), k


def test_parquet_round_trip_equals_generator(small_dataset, small_options):
    generator = AdsLogGenerator(small_options, seed=7)
    expected = concat_batches([generator.chunk(256 if i < 11 else 3000 - 11 * 256, split="train",
                                               index=i) for i in range(12)])
    reader = DatasetReader(small_dataset)
    stream = ParquetStream(reader, split_units(reader.manifest, "train"), batch_size=3000,
                           seed=0, shuffle=False, epochs=1)
    batches = list(stream)
    assert len(batches) == 1
    assert_batches_equal(batches[0], expected)
    batches[0].validate(reader.schema)


def test_manifest_counts(small_dataset, small_options):
    manifest = read_manifest(small_dataset)
    assert manifest.rows("train") == 3000 and manifest.rows("eval") == 500
    assert manifest.splits["train"][0].row_groups[:2] == (256, 256)
    generator = AdsLogGenerator(small_options, seed=7)
    assert manifest.schema == generator.schema
    tokens = sum(generator.chunk(min(256, 3000 - s), split="train", index=i).num_events
                 for i, s in enumerate(range(0, 3000, 256)))
    assert manifest.tokens("train") == tokens


def test_table_round_trip_with_sequence_dense():
    options = SynthOptions(num_items=100, num_users=10, seq_dense_dim=3, mean_length=5.0,
                           max_length=20)
    generator = AdsLogGenerator(options, seed=1)
    batch = generator.chunk(40, split="train", index=0)
    table = batch_to_table(batch, generator.schema)
    assert_batches_equal(table_to_batch(table, generator.schema), batch)
    assert torch.equal(table_to_batch(table, generator.schema).seq_dense, batch.seq_dense)
    # A sliced table (offsets not starting at 0) converts the same.
    sliced = table_to_batch(table.slice(10, 5), generator.schema)
    assert torch.equal(sliced.seq_item_ids, batch.select(torch.arange(10, 15)).seq_item_ids)


def test_truncation_keeps_most_recent_events():
    offsets = np.array([0, 5, 5, 7])
    new_offsets, keep = truncate_recent(offsets, 3)
    assert new_offsets.tolist() == [0, 3, 3, 5]
    assert keep.tolist() == [2, 3, 4, 5, 6]
    assert truncate_recent(offsets, 5)[1] is None


def test_generator_is_deterministic_and_realistic(small_options):
    SMALL = small_options
    a = AdsLogGenerator(SMALL, seed=5).chunk(4000, split="train", index=2)
    b = AdsLogGenerator(SMALL, seed=5).chunk(4000, split="train", index=2)
    c = AdsLogGenerator(SMALL, seed=6).chunk(4000, split="train", index=2)
    assert torch.equal(a.seq_item_ids, b.seq_item_ids)
    assert not torch.equal(a.candidate_item_ids, c.candidate_item_ids)
    lengths = a.seq_lengths()
    assert int(lengths.max()) <= SMALL.max_length and float((lengths == 0).float().mean()) > 0.02
    # Timestamps are older than the request and rise within a history.
    rows = torch.repeat_interleave(torch.arange(4000), lengths)
    assert bool((a.seq_timestamps < a.request_timestamps[rows]).all())
    click = a.labels["click"].mean().item()
    assert 0.01 < click < 0.08
    assert bool((a.labels["conversion"] <= a.labels["click"]).all())


def test_zipf_lengths_are_heavy_tailed_and_capped():
    options = SynthOptions(num_items=100, num_users=10, length_distribution="zipf",
                           length_exponent=1.2, max_length=4096)
    lengths = AdsLogGenerator(options, seed=0).chunk(20000, split="train", index=0).seq_lengths()
    assert int(lengths.max()) <= 4096
    assert float(lengths.float().median()) < 50 and int(lengths.max()) > 1000


def test_label_depends_on_history_candidate_interaction(small_options):
    generator = AdsLogGenerator(small_options, seed=0)
    batch = generator.chunk(40000, split="train", index=0)
    # Share of history events in the candidate's cluster, per row (unweighted proxy).
    rows = torch.repeat_interleave(torch.arange(40000), batch.seq_lengths()).numpy()
    cluster = generator.item_cluster
    match = cluster[batch.seq_item_ids.numpy()] == cluster[batch.candidate_item_ids.numpy()][rows]
    share = np.bincount(rows, match, 40000) / np.maximum(batch.seq_lengths().numpy(), 1)
    click = batch.labels["click"].numpy()
    assert click[share > 0.5].mean() > 2 * click[share < 0.1].mean()


def test_arrow_schema_is_stable(small_dataset):
    import pyarrow.parquet as pq

    schema = pq.ParquetFile(small_dataset / "train-00000.parquet").schema_arrow
    assert schema.field("history_item_id").type == pa.list_(pa.int64())
    assert schema.field("dense").type == pa.list_(pa.float32(), 4)
