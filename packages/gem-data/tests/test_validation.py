"""Every bad input gives a GemDataError naming its location, or is dropped/repaired and counted."""

from __future__ import annotations

import json
import math

import attrs
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from gem_core.errors import GemDataError
from gem_data import format as fmt
from gem_data.arrow_io import table_to_batch
from gem_data.dataset import DatasetReader, split_units
from gem_data.validation import (
    Location,
    ValidationPolicy,
    ValidationReport,
    check_arrays,
    check_batch,
)


def read_all(directory, policy=None):
    reader = DatasetReader(directory, policy=policy or ValidationPolicy())
    tables = [reader.read(u) for u in split_units(reader.manifest, "train")]
    return reader, tables


def first_event_of_row(batch, row):
    return int(batch.seq_offsets[row])


def with_history_item(row, value):
    def mutate(batch):
        ids = batch.seq_item_ids.clone()
        ids[first_event_of_row(batch, row)] = value
        return attrs.evolve(batch, seq_item_ids=ids)
    return mutate




@pytest.mark.parametrize("value", [-3, 10_000])
def test_history_id_out_of_range_names_location(make_dataset, value):
    # Pick a row with a history in the second row group (rows 32..63) of the fixture's data.
    reader = DatasetReader(make_dataset(name="good"))
    table = reader.read(split_units(reader.manifest, "train")[1])
    lengths = table_to_batch(table, reader.schema).seq_lengths()
    row = 32 + int(torch.nonzero(lengths > 0)[0])
    bad = make_dataset(mutate=with_history_item(row, value), name="bad")
    with pytest.raises(GemDataError) as info:
        read_all(bad)
    message = str(info.value)
    assert "train-00000.parquet" in message and "row group 1" in message
    assert f"row {row} " in message and "'history_item_id'" in message and str(value) in message


def test_candidate_feature_out_of_range_drop_and_clamp(make_dataset):
    def mutate(batch):
        adv = batch.candidate_sparse["advertiser"].clone()
        adv[5] = 999
        adv[40] = -1
        return attrs.evolve(batch, candidate_sparse={**batch.candidate_sparse, "advertiser": adv})

    bad = make_dataset(mutate=mutate)
    with pytest.raises(GemDataError, match=r"row group 0, row 5 .*'candidate.advertiser' value 999"):
        read_all(bad)
    reader, tables = read_all(bad, ValidationPolicy(ids="drop"))
    assert sum(t.num_rows for t in tables) == 62
    assert reader.report.to_dict()["rows_dropped"]["ids"] == 2
    reader, tables = read_all(bad, ValidationPolicy(ids="clamp"))
    assert sum(t.num_rows for t in tables) == 64
    assert reader.report.to_dict()["rows_repaired"]["ids"] == 2
    assert tables[0].column("candidate.advertiser")[5].as_py() == 19
    assert tables[1].column("candidate.advertiser")[8].as_py() == 0


def test_history_id_clamp_and_drop(make_dataset):
    def mutate(batch):
        ids = batch.seq_item_ids.clone()
        ids[0], ids[-1] = -1, 10_000
        return attrs.evolve(batch, seq_item_ids=ids)

    bad = make_dataset(mutate=mutate)
    reader, tables = read_all(bad, ValidationPolicy(ids="clamp"))
    values = [t.column("history_item_id").combine_chunks().flatten().to_numpy() for t in tables]
    assert values[0][0] == 0 and values[-1][-1] == 499
    assert reader.report.to_dict()["rows_repaired"]["ids"] == 2
    reader, tables = read_all(bad, ValidationPolicy(ids="drop"))
    assert sum(t.num_rows for t in tables) == 62


def test_sparse_bag_id_out_of_range(make_dataset):
    def mutate(batch):
        bag = batch.sparse["context"]
        values = bag.values.clone()
        values[3] = 16
        return attrs.evolve(batch, sparse={**batch.sparse,
                                           "context": type(bag)(values, bag.offsets)})

    with pytest.raises(GemDataError, match=r"row 3 .*'sparse.context' value 16 is outside \[0, 16\)"):
        read_all(make_dataset(mutate=mutate))


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_dense(make_dataset, value):
    def mutate(batch):
        dense = batch.dense.clone()
        dense[7, 2] = value
        return attrs.evolve(batch, dense=dense)

    bad = make_dataset(mutate=mutate)
    with pytest.raises(GemDataError, match=r"row 7 .*'dense' value (nan|inf) is not finite"):
        read_all(bad)
    reader, tables = read_all(bad, ValidationPolicy(dense="clamp"))
    assert tables[0].column("dense")[7].as_py()[2] == 0.0
    assert reader.report.to_dict()["rows_repaired"]["dense"] == 1
    reader, tables = read_all(bad, ValidationPolicy(dense="drop"))
    assert reader.report.to_dict()["total_dropped"] == 1


@pytest.mark.parametrize("value", [2.0, -1.0, math.nan])
def test_label_outside_zero_one(make_dataset, value):
    def mutate(batch):
        click = batch.labels["click"].clone()
        click[33] = value
        return attrs.evolve(batch, labels={**batch.labels, "click": click})

    bad = make_dataset(mutate=mutate)
    with pytest.raises(GemDataError, match=r"row group 1, row 33 .*'label.click' value .* not 0 or 1"):
        read_all(bad)
    reader, tables = read_all(bad, ValidationPolicy(labels="drop"))
    assert sum(t.num_rows for t in tables) == 63
    assert reader.report.to_dict()["rows_dropped"]["labels"] == 1


def _rewrite(directory, column, array):
    path = directory / "train-00000.parquet"
    table = pq.read_table(path)
    table = table.set_column(table.schema.get_field_index(column), column, array)
    pq.write_table(table, path, row_group_size=32)
    return table


def test_history_lengths_not_matching(make_dataset):
    directory = make_dataset()
    table = pq.read_table(directory / "train-00000.parquet")
    actions = table.column(fmt.HISTORY_ACTION).combine_chunks()
    lengths = actions.value_lengths().to_numpy()
    row = int(np.flatnonzero(lengths > 0)[0])
    offsets = actions.offsets.to_numpy().copy()
    values = actions.values.to_numpy()
    # Drop the last action of `row`: its actions are one shorter than its items.
    keep = np.ones(values.size, dtype=bool)
    keep[offsets[row + 1] - 1] = False
    offsets[row + 1:] -= 1
    _rewrite(directory, fmt.HISTORY_ACTION,
             pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values[keep])))
    with pytest.raises(GemDataError, match=rf"row {row} .*'history_action' has {lengths[row] - 1} "
                                           rf"values where 'history_item_id' length {lengths[row]}"):
        read_all(directory)
    reader, tables = read_all(directory, ValidationPolicy(structure="drop"))
    assert reader.report.to_dict()["rows_dropped"]["structure"] == 1


def test_backward_offsets_in_a_column_are_corrupt():
    where = Location(file="f.parquet", row_group=2, first_row=64)
    values = pa.array(np.arange(6, dtype=np.int64))
    bad = pa.ListArray.from_buffers(pa.list_(pa.int64()), 3,
                                    [None, pa.py_buffer(np.array([0, 4, 2, 6], np.int32))],
                                    children=[values])
    with pytest.raises(GemDataError, match=r"f.parquet: row group 2: feature 'history_item_id': "
                                           r"corrupt column"):
        check_arrays(pa.table({"history_item_id": bad}), where)


@pytest.mark.parametrize("offsets, message", [
    ([0, 4, 2, 6], "offsets decrease at row 1"),       # a negative length
    ([0, 2, 4, 5], "offsets end at 5 but there are 6 values"),
    ([1, 2, 4, 6], "offsets must start at 0"),
])
def test_in_memory_batch_offsets(small_options, offsets, message):
    from gem_data.generator import AdsLogGenerator

    generator = AdsLogGenerator(small_options, seed=0)
    batch = generator.chunk(3, split="train", index=0)
    bag = batch.sparse["user_segment"]
    bad = attrs.evolve(batch, sparse={**batch.sparse, "user_segment": type(bag)(
        torch.zeros(6, dtype=torch.int64), torch.tensor(offsets))})
    check_batch(batch, generator.schema)
    with pytest.raises(GemDataError, match=rf"feature 'sparse.user_segment'.*{message}"):
        check_batch(bad, generator.schema)


def test_in_memory_batch_event_fields_must_match(small_options):
    from gem_data.generator import AdsLogGenerator

    generator = AdsLogGenerator(small_options, seed=0)
    batch = generator.chunk(8, split="train", index=0)
    bad = attrs.evolve(batch, seq_action_ids=batch.seq_action_ids[:-1])
    with pytest.raises(GemDataError, match="'seq_action_ids' has"):
        check_batch(bad, generator.schema)


def test_truncated_file(make_dataset):
    directory = make_dataset()
    path = directory / "train-00000.parquet"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(GemDataError, match=r"train-00000.parquet: truncated or corrupt Parquet"):
        read_all(directory)


def test_corrupt_page(make_dataset):
    directory = make_dataset()
    path = directory / "train-00000.parquet"
    data = bytearray(path.read_bytes())
    data[200:1200] = b"\xff" * 1000  # clobber the first column chunks, keep the footer
    path.write_bytes(bytes(data))
    with pytest.raises(GemDataError, match=r"train-00000.parquet: (row group 0: )?.*corrupt"):
        read_all(directory)


def test_empty_file(make_dataset):
    directory = make_dataset()
    (directory / "train-00000.parquet").write_bytes(b"")
    with pytest.raises(GemDataError, match=r"train-00000.parquet: empty file"):
        read_all(directory)


def test_schema_mismatch(make_dataset):
    directory = make_dataset()
    _rewrite(directory, "candidate.category",
             pa.array(np.zeros(64, dtype=np.float64)))
    with pytest.raises(GemDataError, match=r"schema mismatch: feature 'candidate.category' is "
                                           r"double, expected int64"):
        read_all(directory)


def test_manifest_problems(make_dataset, tmp_path):
    with pytest.raises(GemDataError, match="manifest.json is missing"):
        DatasetReader(tmp_path)
    directory = make_dataset()
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["splits"]["train"]["files"][0]["rows"] = 65
    (directory / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(GemDataError, match="row groups sum to 64 but rows is 65"):
        DatasetReader(directory)


def test_report_counts_each_row_group_once():
    report = ValidationReport()
    where = Location(file="f", row_group=0, first_row=0)
    report.add(where, 10, {"ids": 1}, {}, 2)
    report.add(where, 10, {"ids": 1}, {}, 2)  # the same row group in a later epoch
    assert report.to_dict()["rows_checked"] == 10
    assert report.to_dict()["rows_dropped"]["ids"] == 1
    assert report.to_dict()["histories_truncated"] == 2


def test_null_values_are_structure_errors(make_dataset):
    directory = make_dataset()
    labels = pq.read_table(directory / "train-00000.parquet").column("label.click").to_pylist()
    labels[4] = None
    path = directory / "train-00000.parquet"
    table = pq.read_table(path)
    schema = table.schema.set(table.schema.get_field_index("label.click"),
                              pa.field("label.click", pa.float32(), nullable=True))
    table = table.cast(schema).set_column(table.schema.get_field_index("label.click"),
                                          pa.field("label.click", pa.float32()),
                                          pa.array(labels, pa.float32()))
    pq.write_table(table, path, row_group_size=32)
    with pytest.raises(GemDataError, match=r"row 4 .*'label.click' value null"):
        read_all(directory)
