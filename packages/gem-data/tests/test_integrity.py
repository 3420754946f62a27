"""Data set integrity: the files are the manifest's (sizes, SHA-256, page CRCs, row groups, no
unlisted files, paths inside the directory), timestamps are checked under the ``time`` policy,
and what validation dropped or repaired is in the training log."""

from __future__ import annotations

import json
import logging
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gem_core.errors import GemDataError
from gem_data.check import validate_dataset
from gem_data.dataset import DatasetReader, split_units
from gem_data.manifest import read_manifest, with_digests, write_manifest
from gem_data.validation import ValidationPolicy

FILE = "train-00000.parquet"
FLOOR_1990 = 631152000  # 1990-01-01 00:00:00 UTC


def read_all(directory, policy=None):
    reader = DatasetReader(directory, policy=policy or ValidationPolicy())
    tables = [reader.read(u) for u in split_units(reader.manifest, "train")]
    return reader, tables


def rewrite_rows(directory, edit):
    """Rewrite the train file after ``edit(rows)`` and re-record its digest in the manifest
    (these tests reach the row checks; a file changed behind the manifest is refused first)."""
    path = directory / FILE
    table = pq.read_table(path)
    rows = table.to_pylist()
    edit(rows)
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path, row_group_size=32)
    write_manifest(directory, with_digests(directory, read_manifest(directory)))


def with_history(rows, start=0, at_least=3):
    return next(i for i in range(start, len(rows))
                if len(rows[i]["history_timestamp"]) >= at_least)


# -- the files are the manifest's ----------------------------------------------------------------

def test_flipped_bits_in_a_dense_page_name_the_file_and_row_group(make_dataset):
    directory = make_dataset()
    manifest = json.loads((directory / "manifest.json").read_text())
    entry = manifest["splits"]["train"]["files"][0]
    assert entry["size"] == (directory / FILE).stat().st_size and len(entry["sha256"]) == 64
    # Flip the lowest bit of 8 bytes inside row group 1's page of plain float32 `dense`
    # values: every value stays finite and in range, so no row check can see it.
    column = pq.ParquetFile(directory / FILE).metadata.row_group(1).column(
        pq.ParquetFile(directory / FILE).schema_arrow.get_field_index("dense"))
    position = column.data_page_offset + column.total_compressed_size - 40
    data = bytearray((directory / FILE).read_bytes())
    for k in range(8):
        data[position + k] ^= 0x01
    (directory / FILE).write_bytes(bytes(data))
    with pytest.raises(GemDataError, match=rf"{FILE}: row group 1: .*CRC does not match"):
        read_all(directory)
    result = validate_dataset(directory)
    assert any(f"{FILE}: SHA-256" in e and "differs from the manifest's" in e
               for e in result["errors"])
    assert any("row group 1" in e and "CRC" in e for e in result["errors"])


def test_a_file_of_another_size_is_refused_before_reading(make_dataset):
    directory = make_dataset()
    size = (directory / FILE).stat().st_size
    with open(directory / FILE, "ab") as handle:
        handle.write(b"\0" * 16)
    with pytest.raises(GemDataError, match=rf"{FILE}: {size + 16} bytes where the manifest "
                                           rf"records {size}"):
        read_all(directory)


def test_row_groups_and_files_the_manifest_does_not_list_are_errors(make_dataset):
    directory = make_dataset()  # 64 train rows in row groups of 32
    manifest = json.loads((directory / "manifest.json").read_text())
    train = manifest["splits"]["train"]["files"][0]
    train["row_groups"], train["rows"] = [32], 32  # row group 1 left out
    (directory / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(GemDataError, match=rf"{FILE}: the file has 2 row groups of \[32, 32\] "
                                           r"rows but the manifest lists 1 of \[32\]: row groups "
                                           "the manifest does not list"):
        read_all(directory)

    directory = make_dataset(name="extra")
    (directory / "part").mkdir()
    (directory / "part" / "more.parquet").write_bytes((directory / FILE).read_bytes())
    with pytest.raises(GemDataError, match=r"Parquet files not listed in manifest.json: "
                                           r"part/more.parquet"):
        read_all(directory)
    assert "not listed" in validate_dataset(directory)["errors"][0]
    (directory / "part" / "more.parquet").unlink()
    (directory / FILE).unlink()
    with pytest.raises(GemDataError, match=rf"{FILE}: file listed in the manifest does not "
                                           "exist"):
        read_all(directory)


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink"])
def test_manifest_paths_stay_inside_the_data_set(make_dataset, tmp_path, kind):
    directory = make_dataset()
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    os.replace(directory / FILE, outside / FILE)
    manifest = json.loads((directory / "manifest.json").read_text())
    entry = manifest["splits"]["train"]["files"][0]
    if kind == "dotdot":
        entry["path"] = f"../elsewhere/{FILE}"
        expected = r"must be relative to the data set directory and stay inside it"
    elif kind == "absolute":
        entry["path"] = str(outside / FILE)
        expected = r"must be relative to the data set directory and stay inside it"
    else:
        (directory / "linked").symlink_to(outside, target_is_directory=True)
        entry["path"] = f"linked/{FILE}"
        expected = r"leads out of the data set directory .* through a symbolic link"
    (directory / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(GemDataError, match=rf"manifest.json: split 'train': file path .*"
                                           rf"{expected}"):
        read_all(directory)
    assert "file path" in validate_dataset(directory)["errors"][0]


def test_data_sets_without_digests_warn_and_get_them_from_validate(make_dataset, caplog):
    from gem_data.dataset import warn_without_digests

    directory = make_dataset()
    manifest = json.loads((directory / "manifest.json").read_text())
    for split in manifest["splits"].values():
        for entry in split["files"]:
            del entry["size"], entry["sha256"]
    (directory / "manifest.json").write_text(json.dumps(manifest))
    assert read_manifest(directory).splits["train"][0].sha256 is None
    with caplog.at_level(logging.WARNING, logger="gem_data.dataset"):
        warn_without_digests(directory, read_manifest(directory))
    assert f"gem data validate --write-digests {directory}" in caplog.text
    assert rows_of(read_all(directory)[1]) == 64  # accepted: it is read as before
    result = validate_dataset(directory)
    assert not result["errors"] and "--write-digests" in result["warnings"][0]
    result = validate_dataset(directory, write_digests=True)
    assert not result["errors"] and result["digests_written"] == 2
    entry = read_manifest(directory).splits["train"][0]
    assert entry.size == (directory / FILE).stat().st_size and entry.sha256
    assert validate_dataset(directory)["warnings"] == []


def rows_of(tables):
    return sum(t.num_rows for t in tables)


# -- timestamps ----------------------------------------------------------------------------------

def test_placeholder_event_times_are_errors_drops_or_trims(make_dataset):
    directory = make_dataset()
    chosen = []

    def edit(rows):
        chosen.append(with_history(rows, 40))
        rows[chosen[0]]["history_timestamp"][1] = -(2**62)

    rewrite_rows(directory, edit)
    row = chosen[0]
    with pytest.raises(GemDataError, match=rf"row group 1, row {row} .*'history_timestamp' value "
                                           rf"-4611686018427387904 \(.*\) of event 1 is before "
                                           r"data.options.validation.time_floor 0 "
                                           r"\(1970-01-01 00:00:00 UTC\)"):
        read_all(directory)
    reader, tables = read_all(directory, ValidationPolicy(time="drop"))
    assert rows_of(tables) == 63 and reader.report.to_dict()["rows_dropped"]["time"] == 1
    reader, tables = read_all(directory, ValidationPolicy(time="trim"))
    assert rows_of(tables) == 64 and reader.report.to_dict()["rows_repaired"]["time"] == 1
    before = pq.read_table(directory / FILE).column("history_timestamp")[row].as_py()
    after = tables[1].column("history_timestamp")[row - 32].as_py()
    assert after == before[:1] + before[2:]
    # Event features lose the same event.
    items = pq.read_table(directory / FILE).column("event.item")[row].as_py()
    assert tables[1].column("event.item")[row - 32].as_py() == items[:1] + items[2:]


def test_histories_out_of_order_and_requests_before_the_floor(make_dataset):
    directory = make_dataset()
    chosen = []

    def edit(rows):
        chosen.append(with_history(rows, 3))
        stamps = rows[chosen[0]]["history_timestamp"]
        stamps[0], stamps[1] = stamps[1], stamps[0] - 1  # the second event goes back in time
        rows[50]["request_timestamp"] = 600_000_000  # 1989
        rows[50]["history_timestamp"] = [t - 2_000_000_000 + 600_000_000
                                         for t in rows[50]["history_timestamp"]]

    rewrite_rows(directory, edit)
    row = chosen[0]
    with pytest.raises(GemDataError, match=rf"row {row} .*'history_timestamp' goes back in time "
                                           r"at event 1: \d+ then \d+ \(history events must be "
                                           "oldest first"):
        read_all(directory)
    reader, tables = read_all(directory, ValidationPolicy(time="trim"))
    assert rows_of(tables) == 63  # order cannot be trimmed: the request is dropped
    assert reader.report.to_dict()["rows_dropped"]["time"] == 1
    floor = ValidationPolicy(time="drop", time_floor=FLOOR_1990)
    reader, tables = read_all(directory, floor)
    assert rows_of(tables) == 62 and reader.report.to_dict()["rows_dropped"]["time"] == 2
    with pytest.raises(GemDataError, match=r"row 50 .*'request_timestamp' value 600000000 "
                                           r"\(1989-01-05 .* UTC\) is before .*time_floor "
                                           r"631152000 \(1990-01-01 00:00:00 UTC\)"):
        reader = DatasetReader(directory, policy=ValidationPolicy(time_floor=FLOOR_1990))
        reader.read(split_units(reader.manifest, "train")[1])


def test_a_null_id_with_structure_drop_is_dropped_and_counted(make_dataset):
    directory = make_dataset()
    path = directory / FILE

    def edit(rows):
        rows[with_history(rows, 0, 1)]["event.item"][0] = None
        rows[40]["candidate.item"][0] = None
        rows[with_history(rows, 41, 1)]["event.genres"][0] = None
        rows[with_history(rows, 41, 1) + 1]["sparse.segment"] = [None]

    table = pq.read_table(path)
    rows = table.to_pylist()
    edit(rows)
    nullable = pa.schema([f.with_nullable(True) for f in table.schema])
    pq.write_table(pa.Table.from_pylist(rows, schema=nullable), path, row_group_size=32)
    write_manifest(directory, with_digests(directory, read_manifest(directory)))
    reader, tables = read_all(directory, ValidationPolicy(structure="drop", ids="drop"))
    assert rows_of(tables) == 60
    assert reader.report.to_dict()["rows_dropped"] == {
        "structure": 4, "ids": 0, "dense": 0, "labels": 0, "time": 0}


# -- counts in the log ---------------------------------------------------------------------------

def test_drop_and_repair_counts_are_logged_after_each_evaluation_and_at_the_end(
        make_dataset, tmp_path, caplog):
    from gem_core.config import load_config
    from gem_core.plugins import build_plugins
    from gem_core.train.trainer import train

    directory = make_dataset(rows=128)
    chosen = []

    def edit(rows):
        chosen.append(with_history(rows, 0))
        rows[chosen[0]]["history_timestamp"][0] = -(2**62)  # trimmed
        rows[5]["candidate.advertiser"][0] = 999  # dropped (20 advertisers)

    rewrite_rows(directory, edit)
    overrides = ["data.source=parquet", f"data.path={directory}",
                 'data.options={prefetch = 1, validation = {ids = "drop", time = "trim"}}',
                 "train.steps=2", "train.batch_size=16", "data.eval_rows=16",
                 "train.eval_batch_size=16", "train.warmup_steps=1", "train.eval_every=1",
                 "train.checkpoint_every=0", "data.max_seq_len=16", "model.num_layers=1"]
    with caplog.at_level(logging.INFO, logger="gem_core.train.data_log"):
        summary = train(load_config(overrides=overrides), build_plugins(), tmp_path / "run",
                        progress=False).summary
    lines = [r.getMessage() for r in caplog.records if r.name == "gem_core.train.data_log"]
    assert [line.split(":")[0] for line in lines] == [
        "data at step 1", "data at step 2", "data at the end of the run"]
    assert summary["data"]["rows_dropped"]["ids"] == 1
    assert summary["data"]["rows_repaired"]["time"] == 1
    assert "1 dropped (ids 1)" in lines[-1] and "1 repaired (time 1)" in lines[-1]
    assert all(r.levelno == logging.WARNING for r in caplog.records
               if r.name == "gem_core.train.data_log")
