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
from gem_core.jagged import Jagged
from gem_data.dataset import DatasetReader, split_units
from gem_data.manifest import read_manifest, with_digests, write_manifest
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


def rows_read(tables):
    return sum(t.num_rows for t in tables)


def edit_rows(directory, edit, nullable=False):
    """Rewrite the train file after ``edit(rows)`` changed its rows (Python dicts)."""
    path = directory / "train-00000.parquet"
    table = pq.read_table(path)
    rows = table.to_pylist()
    edit(rows)
    schema = table.schema
    if nullable:
        schema = pa.schema([f.with_nullable(True) for f in schema])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=32)
    record_digests(directory)
    return rows


def record_digests(directory):
    """The manifest re-records the rewritten file's size and SHA-256: these tests edit files
    on purpose to reach the row checks (a file changed behind the manifest's back is refused
    first, see test_integrity.py)."""
    write_manifest(directory, with_digests(directory, read_manifest(directory)))


def with_history(rows, start=0):
    """Index of the first row at or after ``start`` with at least two events."""
    return next(i for i in range(start, len(rows)) if len(rows[i]["history_timestamp"]) >= 2)


# -- ids ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [-3, 500, 2**40])
def test_dense_policy_event_id_out_of_range(make_dataset, value):
    directory = make_dataset()
    rows = []

    def edit(r):
        rows.append(with_history(r, 32))
        r[rows[0]]["event.item"][1] = value

    edit_rows(directory, edit)
    row = rows[0]
    with pytest.raises(GemDataError) as info:
        read_all(directory)
    message = str(info.value)
    assert "train-00000.parquet" in message and "row group 1" in message
    assert f"row {row} " in message and "'event.item'" in message and str(value) in message
    assert "table 'item'" in message and "dense" in message
    reader, tables = read_all(directory, ValidationPolicy(ids="drop"))
    assert rows_read(tables) == 63 and reader.report.to_dict()["rows_dropped"]["ids"] == 1
    reader, tables = read_all(directory, ValidationPolicy(ids="clamp"))
    assert rows_read(tables) == 64 and reader.report.to_dict()["rows_repaired"]["ids"] == 1
    clamped = tables[1].column("event.item")[row - 32].as_py()[1]
    assert clamped == (0 if value < 0 else 499)


def test_multi_valued_and_candidate_ids_out_of_range_drop_counts(make_dataset):
    directory = make_dataset()

    def edit(r):
        r[with_history(r)]["event.genres"][0] = [3, 25]       # genre table has 20 rows
        r[5]["candidate.advertiser"][-1] = 999
        r[40]["candidate.genres"][0] = [-1]
        r[41]["sparse.segment"] = [64]

    edit_rows(directory, edit)
    with pytest.raises(GemDataError, match=r"'event.genres' value 25 is outside \[0, 20\)"):
        read_all(directory)
    reader, tables = read_all(directory, ValidationPolicy(ids="drop"))
    distinct = len({with_history(pq.read_table(directory / "train-00000.parquet").to_pylist()),
                    5, 40, 41})
    assert rows_read(tables) == 64 - distinct
    assert reader.report.to_dict()["rows_dropped"]["ids"] == distinct
    reader, tables = read_all(directory, ValidationPolicy(ids="clamp"))
    assert rows_read(tables) == 64
    assert tables[1].column("candidate.genres")[8].as_py()[0] == [0]
    assert tables[1].column("sparse.segment")[9].as_py() == [63]


def test_hash_and_modulo_tables_take_any_64_bit_id(make_dataset):
    directory = make_dataset()

    def edit(r):
        i = with_history(r)
        r[i]["event.ad_id"][0] = -(2**63)
        r[3]["candidate.ad_id"][0] = 2**63 - 1
        r[4]["sparse.context"] = [12345678901, -7]

    edit_rows(directory, edit)
    reader, tables = read_all(directory)
    assert rows_read(tables) == 64 and reader.report.to_dict()["total_dropped"] == 0


# -- structure ---------------------------------------------------------------------------------

def test_request_without_candidates(make_dataset):
    directory = make_dataset()

    def edit(r):
        for key in list(r[7]):
            if key.startswith(("candidate.", "label.")) or key == "candidate_dense":
                r[7][key] = []

    edit_rows(directory, edit)
    with pytest.raises(GemDataError, match=r"row group 0, row 7 .*the request has no candidates"):
        read_all(directory)
    reader, tables = read_all(directory, ValidationPolicy(structure="drop"))
    assert rows_read(tables) == 63
    assert reader.report.to_dict()["rows_dropped"]["structure"] == 1


def test_label_list_length_differs_from_candidates(make_dataset):
    directory = make_dataset()

    def edit(r):
        r[9]["label.click"] = r[9]["label.click"] + [0.0]
        r[50]["label.conversion"] = r[50]["label.conversion"] + [1.0]

    edit_rows(directory, edit)
    with pytest.raises(GemDataError, match=r"row 9 .*'label.click' has \d+ values where the "
                                           r"request's candidate count"):
        read_all(directory)
    reader, tables = read_all(directory, ValidationPolicy(structure="drop"))
    assert rows_read(tables) == 62
    assert reader.report.to_dict()["rows_dropped"]["structure"] == 2


def test_event_feature_length_differs_from_history(make_dataset):
    directory = make_dataset()
    found = []

    def edit(r):
        found.append(with_history(r))
        r[found[0]]["event.action"] = r[found[0]]["event.action"][:-1]

    edit_rows(directory, edit)
    row = found[0]
    with pytest.raises(GemDataError, match=rf"row {row} .*'event.action' has \d+ values where "
                                           r"'history_timestamp' has"):
        read_all(directory)
    reader, tables = read_all(directory, ValidationPolicy(structure="drop"))
    assert rows_read(tables) == 63
    assert reader.report.to_dict()["rows_dropped"]["structure"] == 1


def test_history_dense_width(make_dataset):
    directory = make_dataset()

    def edit(r):
        i = with_history(r)
        r[i]["history_dense"] = r[i]["history_dense"][:-1]

    edit_rows(directory, edit)
    with pytest.raises(GemDataError, match=r"'history_dense' has \d+ values where "
                                           r"'history_timestamp' length \d+ needs"):
        read_all(directory)


def test_multi_valued_feature_with_an_empty_id_list(make_dataset):
    directory = make_dataset()
    found = []

    def edit(r):
        found.append(with_history(r, 33))
        r[found[0]]["event.genres"][1] = []
        r[2]["candidate.genres"][0] = []

    edit_rows(directory, edit)
    with pytest.raises(GemDataError, match=r"row 2 .*'candidate.genres' has an empty id list "
                                           r"for candidate 0"):
        read_all(directory)
    reader, tables = read_all(directory, ValidationPolicy(structure="drop"))
    assert rows_read(tables) == 62
    assert reader.report.to_dict()["rows_dropped"]["structure"] == 2
    # The event message names the event within the row.
    edit_rows(directory, lambda r: r[2].update({"candidate.genres": [[1]] * len(
        r[2]["candidate.item"])}))
    with pytest.raises(GemDataError, match=rf"row {found[0]} .*'event.genres' has an empty id "
                                           r"list for event 1 of the row"):
        read_all(directory)


def test_null_values(make_dataset):
    directory = make_dataset()

    def edit(r):
        r[4]["label.click"] = None
        r[6]["event.genres"] = [[1, None]] * len(r[6]["history_timestamp"]) or None

    edit_rows(directory, edit, nullable=True)
    # Columns are checked in order: the history's event.genres comes before the labels.
    with pytest.raises(GemDataError, match=r"row 6 .*'event.genres' value null"):
        read_all(directory)
    edit_rows(directory, lambda r: r[6].update({"event.genres": [[1]] * len(
        r[6]["history_timestamp"])}), nullable=True)
    with pytest.raises(GemDataError, match=r"row 4 .*'label.click' value null"):
        read_all(directory)
    edit_rows(directory, lambda r: r[6].update({"event.genres": None}), nullable=True)
    reader, tables = read_all(directory, ValidationPolicy(structure="drop"))
    assert rows_read(tables) == 62
    assert reader.report.to_dict()["rows_dropped"]["structure"] == 2


# -- values ------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_dense(make_dataset, value):
    def mutate(batch):
        dense = batch.dense.clone()
        dense[7, 2] = value
        content = batch.candidate_dense.clone()
        first = int(batch.candidate_offsets[40])
        content[first, 0] = value
        return attrs.evolve(batch, dense=dense, candidate_dense=content)

    bad = make_dataset(mutate=mutate)
    with pytest.raises(GemDataError, match=r"row 7 .*'dense' value (nan|inf) is not finite"):
        read_all(bad)
    reader, tables = read_all(bad, ValidationPolicy(dense="clamp"))
    assert tables[0].column("dense")[7].as_py()[2] == 0.0
    assert tables[1].column("candidate_dense")[8].as_py()[0] == 0.0
    assert reader.report.to_dict()["rows_repaired"]["dense"] == 2
    reader, tables = read_all(bad, ValidationPolicy(dense="drop"))
    assert reader.report.to_dict()["total_dropped"] == 2 and rows_read(tables) == 62


@pytest.mark.parametrize("value", [2.0, -1.0, math.nan])
def test_label_outside_zero_one(make_dataset, value):
    def mutate(batch):
        click = batch.labels["click"].clone()
        click[int(batch.candidate_offsets[33])] = value
        return attrs.evolve(batch, labels={**batch.labels, "click": click})

    bad = make_dataset(mutate=mutate)
    with pytest.raises(GemDataError, match=r"row group 1, row 33 .*'label.click' value .* of "
                                           r"candidate 0 is not 0 or 1"):
        read_all(bad)
    reader, tables = read_all(bad, ValidationPolicy(labels="drop"))
    assert rows_read(tables) == 63
    assert reader.report.to_dict()["rows_dropped"]["labels"] == 1


def test_history_after_request(make_dataset):
    directory = make_dataset()
    found = []

    def edit(r):
        i = with_history(r)
        found.append(i)
        r[i]["history_timestamp"][-1] = r[i]["request_timestamp"] + 5
        j = with_history(r, 40)
        found.append(j)
        r[j]["history_timestamp"][-1] = r[j]["request_timestamp"]  # equal: allowed

    rows = edit_rows(directory, edit)
    row = found[0]
    with pytest.raises(GemDataError, match=rf"row {row} .*'history_timestamp' value \d+ of event "
                                           rf"{len(rows[row]['history_timestamp']) - 1} is after "
                                           r"the request"):
        read_all(directory)
    reader, tables = read_all(directory, ValidationPolicy(time="drop"))
    assert rows_read(tables) == 63 and reader.report.to_dict()["rows_dropped"]["time"] == 1
    reader, tables = read_all(directory, ValidationPolicy(time="trim"))
    assert rows_read(tables) == 64 and reader.report.to_dict()["rows_repaired"]["time"] == 1
    trimmed = tables[0].slice(row, 1).to_pylist()[0]
    n = len(rows[row]["history_timestamp"]) - 1
    for key in ("history_timestamp", "event.item", "event.genres", "event.ad_id"):
        assert trimmed[key] == rows[row][key][:n], key
    assert trimmed["history_dense"] == pytest.approx(rows[row]["history_dense"][:3 * n])


# -- files and manifests -----------------------------------------------------------------------

def test_backward_offsets_in_a_column_are_corrupt():
    where = Location(file="f.parquet", row_group=2, first_row=64)
    values = pa.array(np.arange(6, dtype=np.int64))
    bad = pa.ListArray.from_buffers(pa.list_(pa.int64()), 3,
                                    [None, pa.py_buffer(np.array([0, 4, 2, 6], np.int32))],
                                    children=[values])
    with pytest.raises(GemDataError, match=r"f.parquet: row group 2: feature 'event.item': "
                                           r"corrupt column"):
        check_arrays(pa.table({"event.item": bad}), where)


def test_truncated_file(make_dataset):
    directory = make_dataset()
    path = directory / "train-00000.parquet"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(GemDataError, match=rf"train-00000.parquet: {len(data) // 2} bytes where "
                                           rf"the manifest records {len(data)}: the file was "
                                           "truncated"):
        read_all(directory)
    record_digests(directory)  # a manifest written for the truncated file: the format check
    with pytest.raises(GemDataError, match=r"train-00000.parquet: truncated or corrupt Parquet"):
        read_all(directory)
    # `gem data validate` on it, with the eval file emptied too (its digest no longer matches):
    # the summary says which files could not be read, not "0 rows checked".
    from click.testing import CliRunner

    from gem_data.cli import data_group

    (directory / "eval-00000.parquet").write_bytes(b"")
    result = CliRunner().invoke(data_group, ["validate", str(directory)])
    assert result.exit_code == 1
    assert result.stdout.splitlines()[-1] == (
        f"{directory}: 2 files, 0 of 3 row groups and 0 requests checked; 2 of 2 files could "
        "not be read (train-00000.parquet, eval-00000.parquet); 1 files differ from their "
        "recorded SHA-256 (eval-00000.parquet); 3 errors")


def test_empty_file(make_dataset):
    directory = make_dataset()
    (directory / "train-00000.parquet").write_bytes(b"")
    with pytest.raises(GemDataError, match=r"train-00000.parquet: empty file"):
        read_all(directory)


def test_schema_mismatch(make_dataset):
    directory = make_dataset()
    path = directory / "train-00000.parquet"
    table = pq.read_table(path)
    index = table.schema.get_field_index("candidate.advertiser")
    table = table.set_column(index, "candidate.advertiser",
                             table.column(index).cast(pa.list_(pa.float64())))
    pq.write_table(table, path, row_group_size=32)
    record_digests(directory)
    with pytest.raises(GemDataError, match=r"schema mismatch: feature 'candidate.advertiser' is "
                                           r"list<.*double>, expected list<.*int64>"):
        read_all(directory)


def test_manifest_problems(make_dataset, tmp_path):
    with pytest.raises(GemDataError, match="manifest.json is missing"):
        DatasetReader(tmp_path)
    from gem_data.check import validate_dataset, validation_summary

    assert validation_summary(validate_dataset(tmp_path)) == (
        f"{tmp_path}: the data set could not be opened (its manifest or files), so no file was "
        "checked; 1 error")
    directory = make_dataset()
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["splits"]["train"]["files"][0]["rows"] = 65
    (directory / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(GemDataError, match="row groups sum to 64 but rows is 65"):
        DatasetReader(directory)


def test_format_1_manifest_names_the_convert_command(make_dataset):
    directory = make_dataset()
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["format_version"] = 1
    (directory / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(GemDataError, match=r"format 1 data set .*gem data convert .* --out"):
        DatasetReader(directory)


def test_report_counts_each_row_group_once():
    report = ValidationReport()
    where = Location(file="f", row_group=0, first_row=0)
    report.add(where, 10, {"ids": 1}, {}, 2)
    report.add(where, 10, {"ids": 1}, {}, 2)  # the same row group in a later epoch
    assert report.to_dict()["rows_checked"] == 10
    assert report.to_dict()["rows_dropped"]["ids"] == 1
    assert report.to_dict()["histories_truncated"] == 2


# -- in-memory batches -------------------------------------------------------------------------

@pytest.mark.parametrize("offsets, message", [
    ([0, 4, 2, 6], "offsets decrease at row 1"),
    ([0, 2, 4, 5], "offsets end at 5 but there are 6 values"),
    ([1, 2, 4, 6], "offsets must start at 0"),
])
def test_in_memory_batch_offsets(make_chunk, schema, offsets, message):
    batch = make_chunk(3)
    check_batch(batch, schema)
    bag = batch.sparse["segment"]
    bad = attrs.evolve(batch, sparse={**batch.sparse, "segment": Jagged(
        torch.zeros(6, dtype=torch.int64), torch.tensor(offsets))})
    with pytest.raises(GemDataError, match=rf"feature 'sparse.segment'.*{message}"):
        check_batch(bad, schema)
    del bag


def test_in_memory_batch_event_fields_must_match(make_chunk, schema):
    batch = make_chunk(8)
    bad = attrs.evolve(batch, event_ids={**batch.event_ids,
                                         "action": batch.event_ids["action"][:-1]})
    with pytest.raises(GemDataError, match="'event.action' has"):
        check_batch(bad, schema)
    genres = batch.event_ids["genres"]
    bad = attrs.evolve(batch, event_ids={**batch.event_ids, "genres": Jagged(
        genres.values, genres.offsets[:-1])})
    with pytest.raises(GemDataError, match="'event.genres'"):
        check_batch(bad, schema)


# -- the commands ------------------------------------------------------------------------------

def _cli(*args):
    from click.testing import CliRunner

    from gem_data.cli import data_group

    return CliRunner().invoke(data_group, [str(a) for a in args])


def test_inspect_reports_collisions_candidates_and_lengths(small_dataset):
    result = _cli("inspect", small_dataset, "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    train = info["splits"]["train"]
    assert train["requests"] == 3000 and train["candidates"] > 3000
    assert set(train["candidates_per_request"]["histogram"]) == {"1", "2", "3"}
    assert sum(train["candidates_per_request"]["histogram"].values()) == 3000
    assert train["history_length"]["max"] <= 64
    ad = info["tables"]["ad"]
    assert ad["id_policy"] == "hash" and ad["distinct_ids"] > 1000  # 2000 words, 1000 rows
    assert 0 < ad["collision_rate"] <= 1
    assert info["tables"]["item"]["collision_rate"] == 0.0
    assert info["tables"]["item"]["out_of_range_ids"] == 0
    text = _cli("inspect", small_dataset)
    assert text.exit_code == 0 and "table ad: hash, 1000 rows" in text.output


def test_validate_against_a_user_schema(small_dataset, make_dataset, tmp_path):
    from gem_data.check import schema_to_toml

    shown = _cli("schema", "show", small_dataset)
    assert shown.exit_code == 0 and '[[event_features]]\nname = "genres"' in shown.output
    toml = tmp_path / "schema.toml"
    toml.write_text(shown.output)
    checked = _cli("schema", "check", toml, "--json")
    assert checked.exit_code == 0 and json.loads(checked.output)["max_seq_len"] == 64
    assert _cli("validate", small_dataset, "--schema", toml).exit_code == 0
    # A narrower table: the data's ids are now out of range, named with file, row and value.
    toml.write_text(shown.output.replace("num_embeddings = 500", "num_embeddings = 50"))
    result = _cli("validate", small_dataset, "--schema", toml, "--json")
    assert result.exit_code == 1
    report = json.loads(result.output)
    assert any("num_embeddings" in d for d in report["schema_differences"])
    assert "train-00000.parquet: row group 0, row " in report["errors"][0]
    assert "'event.item' value" in report["errors"][0] or "'candidate.item'" in report["errors"][0]
    # Parquet files without a manifest (a user's own export) are checked too.
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "part-0.parquet").write_bytes((make_dataset() / "train-00000.parquet").read_bytes())
    toml.write_text(schema_to_toml(_schema_of(small_dataset)))
    result = _cli("validate", bare, "--schema", toml)
    assert result.exit_code == 0, result.output
    assert "64 requests checked" in result.output
    bad = tmp_path / "bad.toml"
    bad.write_text('tasks = ["click"]\n[[tables]]\nname = "x"\nnum_embeddings = 0\n')
    result = _cli("schema", "check", bad)
    assert result.exit_code != 0 and "tables[0]" in result.output


def _schema_of(directory):
    from gem_data.manifest import read_manifest

    return read_manifest(directory).schema


def test_validate_command_reports_each_bad_row_group(make_dataset):
    directory = make_dataset()

    def edit(r):
        r[3]["candidate.advertiser"][0] = -7
        r[40]["sparse.segment"] = [100000]

    edit_rows(directory, edit)
    result = _cli("validate", directory, "--json")
    assert result.exit_code == 1
    errors = json.loads(result.output)["errors"]
    assert len(errors) == 2
    assert "row group 0, row 3 " in errors[0] and "value -7" in errors[0]
    assert "row group 1, row 40 " in errors[1] and "value 100000" in errors[1]
