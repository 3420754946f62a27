"""``gem data import`` (issue #31): ids stay exact 64-bit integers from CSV and Parquet, through
the written data set and the ``hash`` policy; bad input is a one-line error naming file, row
and column; the train/eval cut, ``eval_fraction = 0``, ``[import.columns]`` keys, ``time_floor``,
per-request context and failed imports follow the documented rules."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from gem_core.errors import GemDataError
from gem_core.ids import map_ids
from gem_data.arrow_io import table_to_batch
from gem_data.dataset import DatasetReader, split_units
from gem_data.importer import build_requests, import_command, import_logs, read_schema_file

BIG = [2**53 + 1, 2**62 + 3, 2**64 - 1]
M64 = (1 << 64) - 1


def signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def splitmix64_row(value: int, size: int) -> int:
    """The ``hash`` policy's row, computed independently in Python integers."""
    z = (value + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return (z ^ (z >> 31)) % size


HASH_SCHEMA = (
    'tasks = ["click"]\n'
    '[[tables]]\nname = "ad"\nnum_embeddings = 1000\nid_policy = "hash"\n'
    '[[tables]]\nname = "topic"\nnum_embeddings = 97\nid_policy = "hash"\n'
    '[[tables]]\nname = "segment"\nnum_embeddings = 13\nid_policy = "hash"\n'
    '[[event_features]]\nname = "ad_id"\ntable = "ad"\n'
    '[[event_features]]\nname = "topics"\ntable = "topic"\nmulti_valued = true\n'
    '[[candidate_features]]\nname = "ad_id"\ntable = "ad"\n'
    '[[candidate_features]]\nname = "topics"\ntable = "topic"\nmulti_valued = true\n'
    '[[sparse_features]]\nname = "seg"\ntable = "segment"\n'
    '[import]\neval_fraction = 0\n')

# Impressions (user, request, time, ad, topics, seg, click) and events (user, time, ad, topics):
# every id column holds 2^53 + 1, 2^62 + 3 and 2^64 - 1 (which float64 cannot all hold).
A, B, C = BIG
IMPRESSIONS = [(C, 1, 100, A, [A, C], [B], 1), (C, 1, 100, C, [B], [B], 0),
               (7, 2, 200, B, [C], [C, A], 1)]
EVENTS = [(C, 50, C, [B, A]), (7, 150, A, [C])]


def write_logs(tmp_path, kind: str):
    imp_cols = ["user_id", "request_id", "timestamp", "ad_id", "topics", "seg", "click"]
    ev_cols = ["user_id", "timestamp", "ad_id", "topics"]
    if kind == "csv":
        def cell(v):
            return "|".join(map(str, v)) if isinstance(v, list) else str(v)
        for name, cols, rows in (("imp", imp_cols, IMPRESSIONS), ("ev", ev_cols, EVENTS)):
            (tmp_path / f"{name}.csv").write_text(
                ",".join(cols) + "\n" + "".join(",".join(cell(v) for v in r) + "\n" for r in rows))
    else:
        u64, lu64 = pa.uint64(), pa.list_(pa.uint64())
        types = {"user_id": u64, "ad_id": u64, "topics": lu64, "seg": lu64}
        for name, cols, rows in (("imp", imp_cols, IMPRESSIONS), ("ev", ev_cols, EVENTS)):
            pq.write_table(pa.table({c: pa.array([r[i] for r in rows], types.get(c))
                                     for i, c in enumerate(cols)}), tmp_path / f"{name}.{kind}")
    (tmp_path / "s.toml").write_text(HASH_SCHEMA)
    return tmp_path / f"imp.{kind}", tmp_path / f"ev.{kind}", tmp_path / "s.toml"


def test_ids_above_2_53_round_trip_exactly_from_csv_and_parquet_into_hash_rows(tmp_path):
    for kind in ("csv", "parquet"):
        work = tmp_path / kind
        work.mkdir()
        imp, ev, schema_file = write_logs(work, kind)
        import_logs(imp, ev, schema_file, work / "out")
        # The written data set holds the ids' exact bits (uint64 as the int64 of its bits).
        table = pq.read_table(work / "out" / "train-00000.parquet")
        assert table.column("user_id").to_pylist() == [signed(C), 7], kind
        assert table.column("candidate.ad_id").to_pylist() == [[signed(A), signed(C)],
                                                               [signed(B)]], kind
        assert table.column("candidate.topics").to_pylist() == [
            [[signed(A), signed(C)], [signed(B)]], [[signed(C)]]], kind
        assert table.column("sparse.seg").to_pylist() == [[signed(B)], [signed(C), signed(A)]]
        assert table.column("event.ad_id").to_pylist() == [[signed(C)], [signed(A)]], kind
        assert table.column("event.topics").to_pylist() == [[[signed(B), signed(A)]],
                                                            [[signed(C)]]], kind
        # Read back as training reads it, then mapped by the hash policy to embedding rows.
        reader = DatasetReader(work / "out")
        schema = reader.schema
        batch = table_to_batch(reader.read(split_units(reader.manifest, "train")[0]), schema)
        rows = map_ids(batch.candidate_ids["ad_id"], schema.table("ad")).tolist()
        assert rows == [splitmix64_row(v, 1000) for v in (A, C, B)], kind
        rows = map_ids(batch.candidate_ids["topics"].values, schema.table("topic")).tolist()
        assert rows == [splitmix64_row(v, 97) for v in (A, C, B, C)], kind
        rows = map_ids(batch.sparse["seg"].values, schema.table("segment")).tolist()
        assert rows == [splitmix64_row(v, 13) for v in (B, C, A)], kind
        rows = map_ids(batch.event_ids["ad_id"], schema.table("ad")).tolist()
        assert rows == [splitmix64_row(v, 1000) for v in (C, A)], kind
        assert len({splitmix64_row(v, 1000) for v in BIG}) == 3  # distinct rows, not collapsed


def test_csv_cell_mixing_negative_and_uint64_ids_is_exact(tmp_path):
    imp, ev, schema_file = write_logs(tmp_path, "csv")
    imp.write_text("user_id,request_id,timestamp,ad_id,topics,seg,click\n"
                   f"1,1,100,-5,-3|{C}|{A},{C}|-1,1\n")
    schema, options = read_schema_file(schema_file)
    batch = build_requests(imp, ev, schema, options)["train"]
    assert batch.candidate_ids["ad_id"].tolist() == [-5]
    assert batch.candidate_ids["topics"].values.tolist() == [-3, -1, A]
    assert batch.sparse["seg"].values.tolist() == [-1, -1]


@pytest.mark.parametrize("cell,pattern", [
    (f"{2**64}", r"imp\.csv, line 3, column 'ad_id': candidate feature 'ad_id': "
                 r"18446744073709551616 does not fit in 64 bits"),
    ("1e3", r"imp\.csv, line 3, column 'ad_id': candidate feature 'ad_id': '1e3' is not an "
            r"integer id"),
])
def test_csv_id_that_is_not_a_64_bit_integer_names_its_line(tmp_path, cell, pattern):
    imp, ev, schema_file = write_logs(tmp_path, "csv")
    imp.write_text("user_id,request_id,timestamp,ad_id,topics,seg,click\n"
                   f"1,1,100,{C},1,2,1\n1,2,200,{cell},1,2,0\n")
    schema, options = read_schema_file(schema_file)
    with pytest.raises(GemDataError, match=pattern):
        build_requests(imp, ev, schema, options)


def test_null_inside_a_parquet_id_list_is_an_error_naming_file_row_and_feature(tmp_path):
    imp, ev, schema_file = write_logs(tmp_path, "parquet")
    near = 2**60
    pq.write_table(pa.table({
        "user_id": [1, 1, 2], "request_id": [1, 2, 3], "timestamp": [10, 20, 30],
        "ad_id": [near + 1, near + 2, near + 3],
        "topics": pa.array([[near + 1], [1, None], [near + 5]], pa.list_(pa.int64())),
        "seg": pa.array([[1], [1], [1]], pa.list_(pa.int64())), "click": [1, 0, 1]}), imp)
    result = CliRunner().invoke(import_command, ["--impressions", str(imp), "--events", str(ev),
                                                 "--schema", str(schema_file),
                                                 "--out", str(tmp_path / "out")])
    assert result.exit_code == 1 and not isinstance(result.exception, AssertionError)
    assert "Traceback" not in result.output
    assert (f"{imp}, row 1, column 'topics': candidate feature 'topics': id 2 of the 2 in the "
            "list is null") in result.output
    assert not (tmp_path / "out").exists()


def test_parquet_sub_second_timestamps_are_whole_seconds_rounded_down(tmp_path):
    """Before: ArrowInvalid "would lose data". Now the documented floor: an event in the same
    second as its request is at the request time, so it is left out of the history."""
    ns = pa.timestamp("ns")
    (tmp_path / "s.toml").write_text(
        'tasks = ["click"]\n[[tables]]\nname = "ad"\nnum_embeddings = 10\n'
        '[[event_features]]\nname = "ad"\ntable = "ad"\n'
        '[[candidate_features]]\nname = "ad"\ntable = "ad"\n[import]\neval_fraction = 0\n')
    pq.write_table(pa.table({"user_id": [1], "request_id": [1],
                             "timestamp": pa.array([10_700_000_000], ns), "ad": [1],
                             "click": [1]}), tmp_path / "imp.parquet")
    pq.write_table(pa.table({"user_id": [1, 1, 1],
                             "timestamp": pa.array([9_900_000_000, 10_100_000_000,
                                                    10_900_000_000], ns),
                             "ad": [2, 3, 4]}), tmp_path / "ev.parquet")
    schema, options = read_schema_file(tmp_path / "s.toml")
    batch = build_requests(tmp_path / "imp.parquet", tmp_path / "ev.parquet", schema,
                           options)["train"]
    assert batch.request_timestamps.tolist() == [10]
    assert batch.seq_timestamps.tolist() == [9] and batch.event_ids["ad"].tolist() == [2]


def test_duplicated_csv_header_column_is_an_error_naming_file_and_column(tmp_path):
    imp, ev, schema_file = write_logs(tmp_path, "csv")
    imp.write_text("user_id,request_id,timestamp,ad_id,topics,seg,click,click\n"
                   "1,1,100,1,1,2,1,0\n")
    schema, options = read_schema_file(schema_file)
    with pytest.raises(GemDataError, match=r"imp\.csv: column 'click' appears 2 times in the "
                                           r"header \(columns 7, 8\)"):
        build_requests(imp, ev, schema, options)


# -- import rules ------------------------------------------------------------------------------

RULES_SCHEMA = ('tasks = ["click"]\n[[tables]]\nname = "ad"\nnum_embeddings = 10\n'
                '[[tables]]\nname = "surface"\nnum_embeddings = 4\n'
                '[[event_features]]\nname = "ad"\ntable = "ad"\n'
                '[[candidate_features]]\nname = "ad"\ntable = "ad"\n'
                '[[sparse_features]]\nname = "surface"\ntable = "surface"\n')


def rules_logs(tmp_path, times, *, import_table="", surfaces=None):
    surfaces = surfaces or [1] * len(times)
    (tmp_path / "imp.csv").write_text("user_id,request_id,timestamp,ad,surface,click\n" + "".join(
        f"{i % 3},r{i},{t},{i % 10},{s},{i % 2}\n" for i, (t, s) in enumerate(zip(times,
                                                                                  surfaces))))
    (tmp_path / "ev.csv").write_text("user_id,timestamp,ad\n0,0,1\n")
    (tmp_path / "s.toml").write_text(RULES_SCHEMA + "[import]\n" + import_table)
    return tmp_path / "imp.csv", tmp_path / "ev.csv", tmp_path / "s.toml"


def run_import(imp, ev, schema_file, out):
    return CliRunner().invoke(import_command, ["--impressions", str(imp), "--events", str(ev),
                                               "--schema", str(schema_file), "--out", str(out)])


def test_tied_times_cannot_skew_the_split_and_the_share_is_reported(tmp_path):
    # 20 requests at distinct times, then 80 at one time: eval_fraction 0.1 wants 10 requests;
    # before, the whole tie (80 %) went to eval. The tie stays whole, on the nearer side.
    times = list(range(1, 21)) + [100] * 80
    imp, ev, schema_file = rules_logs(tmp_path, times, import_table="eval_fraction = 0.1\n")
    result = run_import(imp, ev, schema_file, tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "wrote 100 train + 0 eval requests" in result.output
    assert ("eval split: 0 of 100 requests (0.0 %; eval_fraction = 0.1 asks for 10): 80 "
            "requests share the time 100 at the cut and stay together in train, so there is no "
            "eval split") in result.output
    split = json.loads((tmp_path / "out" / "manifest.json").read_text())["info"]["split"]
    assert split["eval_requests"] == 0 and split["achieved_eval_fraction"] == 0.0
    assert split["tie_at_cut"] == {"time": 100, "requests": 80, "side": "train"}
    # A tie nearer to eval goes there whole: 90 distinct, then 12 at one time: 12 of 102 eval.
    times = list(range(1, 91)) + [500] * 12
    imp, ev, schema_file = rules_logs(tmp_path, times, import_table="eval_fraction = 0.1\n")
    result = run_import(imp, ev, schema_file, tmp_path / "out2")
    assert "wrote 90 train + 12 eval requests" in result.output, result.output
    assert "eval split: 12 of 102 requests (11.8 %" in result.output


def test_eval_fraction_zero_means_no_eval_split(tmp_path):
    times = [5, 6, 2**63 - 1]
    imp, ev, schema_file = rules_logs(tmp_path, times, import_table="eval_fraction = 0\n")
    schema, options = read_schema_file(schema_file)
    splits = build_requests(imp, ev, schema, options)
    assert list(splits) == ["train"]
    assert splits["train"].request_timestamps.tolist() == times


def test_unknown_import_columns_key_is_refused_with_close_matches(tmp_path):
    _, _, schema_file = rules_logs(tmp_path, [1], import_table='[import.columns]\n'
                                                              '"lable.click" = "is_click"\n')
    with pytest.raises(GemDataError, match=r"s\.toml: unknown key 'lable\.click' in "
                                           r"\[import\.columns\] \(did you mean 'label\.click'\?"
                                           r"\); keys are .*candidate\.ad"):
        read_schema_file(schema_file)


def test_times_before_time_floor_fail_at_import_naming_file_and_row(tmp_path):
    imp, ev, schema_file = rules_logs(tmp_path, [10, 20])
    ev.write_text("user_id,timestamp,ad\n0,5,1\n0,-7,1\n")
    schema, options = read_schema_file(schema_file)
    with pytest.raises(GemDataError, match=r"ev\.csv, line 3, column 'timestamp': event time -7 "
                                           r"\(1969-12-31 23:59:53 UTC\) is before "
                                           r"import\.time_floor 0"):
        build_requests(imp, ev, schema, options)
    imp, ev, schema_file = rules_logs(tmp_path, [10, 20], import_table="time_floor = 15\n")
    schema, options = read_schema_file(schema_file)
    with pytest.raises(GemDataError, match=r"imp\.csv, line 2, column 'timestamp': request time "
                                           r"10 .* is before import\.time_floor 15"):
        build_requests(imp, ev, schema, options)
    imp, ev, schema_file = rules_logs(tmp_path, [-10, 20], import_table="time_floor = -100\n"
                                                    "eval_fraction = 0\n")
    schema, options = read_schema_file(schema_file)
    assert build_requests(imp, ev, schema, options)["train"].batch_size == 2


def test_context_feature_that_differs_within_a_request_is_an_error(tmp_path):
    imp, ev, schema_file = rules_logs(tmp_path, [10, 20])
    imp.write_text("user_id,request_id,timestamp,ad,surface,click\n"
                   "1,r1,10,1,2,1\n1,r2,20,3,1,0\n1,r1,10,2,3,0\n")
    schema, options = read_schema_file(schema_file)
    with pytest.raises(GemDataError, match=r"imp\.csv, line 4, column 'surface': request 'r1' "
                                           r"has impressions with different values of context "
                                           r"feature 'surface' \(\[2\] on line 2, \[3\] here\)"):
        build_requests(imp, ev, schema, options)


def test_failed_import_leaves_no_partial_files(tmp_path, monkeypatch):
    from gem_data import writer

    times = list(range(1, 21))
    imp, ev, schema_file = rules_logs(tmp_path, times)
    assert run_import(imp, ev, schema_file, tmp_path / "old").exit_code == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "old").iterdir()}

    def fail(self):
        raise GemDataError("disk full (simulated)")

    monkeypatch.setattr(writer.DatasetWriter, "close", fail)
    for out in (tmp_path / "new", tmp_path / "old"):
        result = run_import(imp, ev, schema_file, out)
        assert result.exit_code == 1 and "disk full (simulated)" in result.output
    assert not (tmp_path / "new").exists()
    assert {p.name: p.read_bytes() for p in (tmp_path / "old").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ev.csv", "imp.csv", "old", "s.toml"]


# -- manifest rules ----------------------------------------------------------------------------


def imported(tmp_path):
    imp, ev, schema_file = rules_logs(tmp_path, list(range(1, 21)),
                                      import_table="eval_fraction = 0.2\n")
    import_logs(imp, ev, schema_file, tmp_path / "ds")
    path = tmp_path / "ds" / "manifest.json"
    return path, json.loads(path.read_text())


def test_manifest_listing_a_file_twice_is_an_error(tmp_path):
    path, manifest = imported(tmp_path)
    files = manifest["splits"]["train"]["files"]
    files.append(dict(files[0], path="./" + files[0]["path"]))
    path.write_text(json.dumps(manifest))
    with pytest.raises(GemDataError, match=rf"{path}: split 'train' file "
                                           r"'\./train-00000\.parquet' is listed twice in split "
                                           r"'train' as 'train-00000\.parquet'"):
        DatasetReader(path.parent)


def test_eval_split_sharing_a_file_with_train_is_an_error(tmp_path):
    path, manifest = imported(tmp_path)
    (path.parent / "eval-00000.parquet").unlink()
    manifest["splits"]["eval"] = manifest["splits"]["train"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(GemDataError, match=rf"{path}: split 'eval' file 'train-00000\.parquet' "
                                           r"is also a file of split 'train'"):
        DatasetReader(path.parent)


def test_parquet_list_of_floats_is_refused_not_truncated_to_ids(tmp_path):
    imp, ev, schema_file = write_logs(tmp_path, "parquet")
    pq.write_table(pa.table({
        "user_id": [1], "request_id": [1], "timestamp": [10], "ad_id": [1],
        "topics": pa.array([[1.5, 2.0]], pa.list_(pa.float64())),
        "seg": pa.array([[1]], pa.list_(pa.int64())), "click": [1]}), imp)
    schema, options = read_schema_file(schema_file)
    with pytest.raises(GemDataError, match=r"imp\.parquet, column 'topics': candidate feature "
                                           r"'topics' must be lists of integer ids, got "
                                           r"list<\w+: double>"):
        build_requests(imp, ev, schema, options)
