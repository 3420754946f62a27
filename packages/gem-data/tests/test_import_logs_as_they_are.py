"""``gem data import`` on logs as they are (issue #28, item 2): requests without an id, missing
values (``error`` / ``default`` / ``drop``, counted per feature), string categories (``hash``,
``vocabulary`` stored with the data set and reused), side tables (``[[import.join]]``), and the
docs/byod.md walkthrough of a Taobao-shaped four-table log run as written."""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from gem_core.errors import GemDataError
from gem_data.importer import (
    _build,
    build_requests,
    import_command,
    import_logs,
    read_schema_file,
)

DOC = Path(__file__).resolve().parents[3] / "docs" / "byod.md"
M64 = (1 << 64) - 1


def signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def splitmix64(value: int) -> int:
    """splitmix64's finalizer in Python integers (independent of gem_core.ids)."""
    z = (value + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def blake_id(text: str) -> int:
    """The documented string id: BLAKE2b-64 of the UTF-8 bytes, little-endian, as int64."""
    return signed(int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(),
                                 "little"))


def history(batch, row, feature):
    s, e = int(batch.seq_offsets[row]), int(batch.seq_offsets[row + 1])
    return batch.event_ids[feature][s:e].tolist(), batch.seq_timestamps[s:e].tolist()


def candidates(batch, row, feature):
    s, e = int(batch.candidate_offsets[row]), int(batch.candidate_offsets[row + 1])
    return batch.candidate_ids[feature][s:e].tolist()


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


BASE = ('tasks = ["click"]\n'
        '[[tables]]\nname = "ad"\nnum_embeddings = 100\n'
        '[[event_features]]\nname = "ad"\ntable = "ad"\n'
        '[[candidate_features]]\nname = "ad"\ntable = "ad"\n')


def build(tmp_path, schema_text, impressions, events, **kwargs):
    schema_file = write(tmp_path / "s.toml", schema_text)
    imp = write(tmp_path / "imp.csv", impressions)
    ev = write(tmp_path / "ev.csv", events)
    schema, options = read_schema_file(schema_file)
    return build_requests(imp, ev, schema, options, **kwargs)


# -- a. requests without an id -----------------------------------------------------------------


def test_without_a_request_id_a_request_is_one_user_at_one_time(tmp_path):
    # Users 1 and 2 share the second 100 (time as the request id would merge them); user 1 has
    # two impressions at 100, one at 200. Before: "has no column 'request_id'".
    batch = build(tmp_path, BASE + '[import]\neval_fraction = 0\n',
                  "user_id,timestamp,ad,click\n1,100,5,1\n2,100,6,0\n1,100,7,0\n1,200,8,1\n",
                  "user_id,timestamp,ad\n1,50,9\n2,60,3\n1,100,4\n")["train"]
    assert batch.request_timestamps.tolist() == [100, 100, 200]
    assert batch.user_ids.tolist() == [1, 2, 1]
    assert candidates(batch, 0, "ad") == [5, 7] and candidates(batch, 1, "ad") == [6]
    assert history(batch, 0, "ad") == ([9], [50])  # the event at 100 is at the request time
    assert history(batch, 2, "ad") == ([9, 4], [50, 100])


def test_request_columns_form_the_key_and_ids_are_a_checked_splitmix_fold(tmp_path,
                                                                          monkeypatch):
    from gem_data import import_requests
    from gem_data.import_log import Log
    from gem_data.importer import ImportOptions

    text = ("user_id,timestamp,session,ad,click\n"
            f"{2**64 - 1},100,a,5,1\n{2**64 - 1},100,b,6,0\n{2**64 - 1},100,a,7,0\n")
    batch = build(tmp_path, BASE + '[import]\neval_fraction = 0\n'
                  'request_columns = ["user_id", "timestamp", "session"]\n',
                  text, "user_id,timestamp,ad\n1,1,1\n")["train"]
    assert batch.batch_size == 2 and candidates(batch, 0, "ad") == [5, 7]
    assert batch.user_ids.tolist() == [-1, -1]  # 2^64 - 1 kept with its bits
    # The ids: h = splitmix64(user), then splitmix64(h ^ v) per column, texts by BLAKE2b-64.
    log = Log(tmp_path / "imp.csv", "impression log", "|", ["user_id", "session"])
    keys = import_requests.read_keys(log, ImportOptions(
        request_columns=("user_id", "timestamp", "session")))
    expected = []
    for session in ("a", "b"):
        h = splitmix64(M64)
        for v in (100, blake_id(session)):
            h = splitmix64(h ^ (v & M64))
        expected.append(signed(h))
    assert keys.ids(np.array([0, 1])).tolist() == expected
    # Two keys with one id stop the import, naming both keys.
    monkeypatch.setattr(import_requests, "_splitmix", lambda v: v * 0)
    with pytest.raises(GemDataError, match=r"imp\.csv: request \(user_id -1, timestamp 100, "
                                           r"session 'a'\) and request \(user_id -1, timestamp "
                                           r"100, session 'b'\) have the same 64-bit request id"):
        build(tmp_path, BASE + '[import]\nrequest_columns = ["user_id", "timestamp", '
                               '"session"]\n', text, "user_id,timestamp,ad\n1,1,1\n")
    with pytest.raises(GemDataError, match="request_column or import.request_columns, not both"):
        build(tmp_path, BASE + '[import]\nrequest_column = "r"\nrequest_columns = ["r"]\n',
              text, "")


# -- b. missing values ---------------------------------------------------------------------------

MISSING = ('tasks = ["click"]\nnum_dense = 1\n'
           '[[tables]]\nname = "ad"\nnum_embeddings = 100\n'
           '[[tables]]\nname = "topic"\nnum_embeddings = 10\n'
           '[[tables]]\nname = "seg"\nnum_embeddings = 10\n'
           '[[event_features]]\nname = "ad"\ntable = "ad"\n'
           '[[event_features]]\nname = "topics"\ntable = "topic"\nmulti_valued = true\n'
           '[[candidate_features]]\nname = "ad"\ntable = "ad"\n'
           '[[sparse_features]]\nname = "seg"\ntable = "seg"\n'
           '[import]\neval_fraction = 0\ndense_columns = ["score"]\n')
MISSING_IMP = ("user_id,request_id,timestamp,ad,seg,score,click\n"
               "1,r1,100,5,1,0.5,1\n1,r1,100,,1,0.5,0\n2,r2,200,6,,,1\n3,r3,300,,2,1.0,0\n")
MISSING_EV = "user_id,timestamp,ad,topics\n1,50,,1|2\n1,60,7,\n2,70,8,3\n"


def test_missing_values_error_names_file_row_and_column_with_the_way_out(tmp_path):
    with pytest.raises(GemDataError, match=r"ev\.csv, line 2, column 'ad': missing value "
                                           r"\(event feature 'ad'; 1 missing in the column\); "
                                           r"to allow it set \[import\.features\.\"event\.ad\"\] "
                                           r"missing = \"default\" or \"drop\""):
        build(tmp_path, MISSING, MISSING_IMP, MISSING_EV)
    with pytest.raises(GemDataError, match=r"import\.features\.'candidate\.ad': missing = "
                                           r"\"default\" needs a default id"):
        read_schema_file(write(tmp_path / "s.toml", MISSING + '[import.features]\n'
                               '"candidate.ad" = { missing = "default" }\n'))
    with pytest.raises(GemDataError, match=r"unknown key 'candidate\.adx' in \[import\.features\] "
                                           r"\(did you mean 'candidate\.ad'\?\)"):
        read_schema_file(write(tmp_path / "s.toml", MISSING + '[import.features]\n'
                               '"candidate.adx" = { missing = "drop" }\n'))


def test_missing_values_default_and_drop_are_applied_and_counted_per_feature(tmp_path):
    policies = ('[import.features]\n'
                '"event.ad" = { missing = "default", default = 99 }\n'
                '"event.topics" = { missing = "drop" }\n'
                '"candidate.ad" = { missing = "drop" }\n'
                '"sparse.seg" = { missing = "default", default = 0 }\n'
                '"dense.score" = { missing = "default", default = -1.5 }\n')
    batch = build(tmp_path, MISSING + policies, MISSING_IMP, MISSING_EV)["train"]
    # r1 keeps its first impression, r3 (its only impression has no ad) is dropped.
    assert batch.request_timestamps.tolist() == [100, 200]
    assert candidates(batch, 0, "ad") == [5] and batch.labels["click"].tolist() == [1, 1]
    assert batch.sparse["seg"].values.tolist() == [1, 0]  # r2's missing seg: the default
    assert batch.dense.tolist() == [[0.5], [-1.5]]
    # User 1's event at 60 has no topics: dropped. The one at 50 has no ad: 99.
    assert history(batch, 0, "ad") == ([99], [50])
    assert batch.event_ids["topics"].values.tolist()[:2] == [1, 2]
    # Counted in the output and the manifest.
    result = CliRunner().invoke(import_command, [
        "--impressions", str(tmp_path / "imp.csv"), "--events", str(tmp_path / "ev.csv"),
        "--schema", str(tmp_path / "s.toml"), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "candidate.ad: 2 missing (rows dropped)" in result.output
    assert "event.ad: 1 missing (given the default 99)" in result.output
    assert "dense.score: 1 missing (given the default -1.5)" in result.output
    assert "dropped for missing values: 2 impressions, 1 events, 1 requests" in result.output
    info = json.loads((tmp_path / "out" / "manifest.json").read_text())["info"]
    assert info["features"]["event.topics"] == {"policy": "drop", "missing": 1}
    assert info["features"]["sparse.seg"] == {"policy": "default", "missing": 1, "default": 0}
    assert info["requests"]["dropped_requests"] == 1
    assert info["requests"]["key"] == ["request_id"]


def test_nulls_inside_parquet_lists_are_removed_and_counted_under_a_policy(tmp_path):
    big = 2**63 + 5
    pq.write_table(pa.table({"user_id": [1], "request_id": [1], "timestamp": [100],
                             "ad": pa.array([big], pa.uint64()), "click": [1]}),
                   tmp_path / "imp.parquet")
    pq.write_table(pa.table({
        "user_id": [1, 1, 1], "timestamp": [10, 20, 30],
        "ad": pa.array([big, None, 3], pa.uint64()),
        "topics": pa.array([[1, None, 2], [None], []], pa.list_(pa.int64()))}),
        tmp_path / "ev.parquet")
    write(tmp_path / "s.toml", MISSING.replace("num_dense = 1", "num_dense = 0")
          .replace('dense_columns = ["score"]', "").replace(
              '[[sparse_features]]\nname = "seg"\ntable = "seg"\n', "").replace(
              '[[tables]]\nname = "seg"\nnum_embeddings = 10\n', "").replace(
              'num_embeddings = 100\n', 'num_embeddings = 100\nid_policy = "hash"\n', 1)
          + '[import.features]\n"event.topics" = { missing = "default", default = 0 }\n'
            '"event.ad" = { missing = "default", default = 4 }\n')
    schema, options = read_schema_file(tmp_path / "s.toml")
    _, report = _build(tmp_path / "imp.parquet", tmp_path / "ev.parquet", schema, options)
    batch = build_requests(tmp_path / "imp.parquet", tmp_path / "ev.parquet", schema,
                           options)["train"]
    assert history(batch, 0, "ad") == ([signed(big), 4, 3], [10, 20, 30])
    topics = batch.event_ids["topics"]
    assert topics.values.tolist() == [1, 2, 0, 0] and topics.offsets.tolist() == [0, 2, 3, 4]
    assert report["features"]["event.topics"] == {"policy": "default", "missing": 2,
                                                  "default": 0, "null_ids_removed": 2}


# -- c. string categories ---------------------------------------------------------------------

STRINGS = ('tasks = ["click"]\n'
           '[[tables]]\nname = "ad"\nnum_embeddings = 100\n'
           '[[tables]]\nname = "tag"\nnum_embeddings = 1000\nid_policy = "hash"\n'
           '[[event_features]]\nname = "ad"\ntable = "ad"\n'
           '[[event_features]]\nname = "tags"\ntable = "tag"\nmulti_valued = true\n'
           '[[candidate_features]]\nname = "ad"\ntable = "ad"\n'
           '[[candidate_features]]\nname = "tags"\ntable = "tag"\nmulti_valued = true\n'
           '[import]\neval_fraction = 0\n')


def test_hashed_strings_are_blake2b_64_of_the_utf8_text_in_csv_and_parquet(tmp_path):
    imp = "user_id,request_id,timestamp,ad,tags,click\n1,1,100,5,café|42,1\n"
    ev = "user_id,timestamp,ad,tags\n1,50,6, pv \n"
    # Without [import.strings] text is still an error (ids are integers).
    with pytest.raises(GemDataError, match=r"imp\.csv, line 2, column 'tags': candidate "
                                           r"feature 'tags': 'café' is not an integer id"):
        build(tmp_path, STRINGS, imp, "user_id,timestamp,ad,tags\n1,50,6,3\n")
    with pytest.raises(GemDataError, match=r'import\.strings\.ad = "hash" gives 64-bit ids, '
                                           r"which table 'ad' \(id_policy dense\) has no rows"):
        read_schema_file(write(tmp_path / "s.toml", STRINGS + '[import.strings]\nad = "hash"\n'))
    csv = build(tmp_path, STRINGS + '[import.strings]\ntag = "hash"\n', imp, ev)["train"]
    assert csv.candidate_ids["tags"].values.tolist() == [blake_id("café"), blake_id("42")]
    assert csv.event_ids["tags"].values.tolist() == [blake_id("pv")]  # trimmed
    # The same data in Parquet, 42 as an integer list: the same ids.
    pq.write_table(pa.table({"user_id": [1], "request_id": [1], "timestamp": [100], "ad": [5],
                             "tags": pa.array([["café", "42"]]), "click": [1]}),
                   tmp_path / "imp.parquet")
    pq.write_table(pa.table({"user_id": [1], "timestamp": [50], "ad": [6],
                             "tags": pa.array([[42]], pa.list_(pa.uint64()))}),
                   tmp_path / "ev.parquet")
    schema, options = read_schema_file(tmp_path / "s.toml")
    parquet = build_requests(tmp_path / "imp.parquet", tmp_path / "ev.parquet", schema,
                             options)["train"]
    assert parquet.candidate_ids["tags"].values.tolist() == [blake_id("café"), blake_id("42")]
    assert parquet.event_ids["tags"].values.tolist() == [blake_id("42")]


VOCAB = ('tasks = ["click"]\n'
         '[[tables]]\nname = "ad"\nnum_embeddings = 100\n'
         '[[tables]]\nname = "btag"\nnum_embeddings = 6\n'
         '[[tables]]\nname = "slot"\nnum_embeddings = 5\n'
         '[[event_features]]\nname = "ad"\ntable = "ad"\n'
         '[[event_features]]\nname = "btag"\ntable = "btag"\n'
         '[[candidate_features]]\nname = "ad"\ntable = "ad"\n'
         '[[sparse_features]]\nname = "slot"\ntable = "slot"\n'
         '[import]\neval_fraction = 0\n'
         '[import.strings]\nbtag = "vocabulary"\nslot = "vocabulary"\n'
         '[import.features]\n"event.btag" = { missing = "default" }\n')
VOCAB_EV = "user_id,timestamp,ad,btag\n1,10,1,pv\n1,20,2,buy\n1,30,3,\n1,40,4,cart\n2,5,1,fav\n"


def test_vocabulary_is_built_stored_with_its_digest_and_reused_with_unknowns_counted(tmp_path):
    write(tmp_path / "s.toml", VOCAB)
    write(tmp_path / "imp.csv", "user_id,request_id,timestamp,ad,slot,click\n"
                                "1,r1,100,1,top,1\n2,r2,100,2,side,0\n")
    write(tmp_path / "ev.csv", VOCAB_EV)
    manifest = import_logs(tmp_path / "imp.csv", tmp_path / "ev.csv", tmp_path / "s.toml",
                           tmp_path / "day1")
    table = pq.read_table(tmp_path / "day1" / "train-00000.parquet")
    # Sorted values from id 2: buy 2, cart 3, fav 4, pv 5; the missing btag gets row 0.
    assert table.column("event.btag").to_pylist() == [[5, 2, 0, 3], [4]]
    assert table.column("sparse.slot").to_pylist() == [[3], [2]]  # side 2, top 3
    entry = manifest.info["vocabularies"]["btag"]
    path = tmp_path / "day1" / entry["path"]
    assert entry["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert entry["size"] == path.stat().st_size and entry["values"] == 4
    assert json.loads(path.read_text())["values"] == ["buy", "cart", "fav", "pv"]
    # Day 2: "share" is not in day 1's vocabulary: the out-of-vocabulary id 1, counted.
    write(tmp_path / "ev2.csv", "user_id,timestamp,ad,btag\n1,10,1,share\n1,20,2,pv\n")
    result = CliRunner().invoke(import_command, [
        "--impressions", str(tmp_path / "imp.csv"), "--events", str(tmp_path / "ev2.csv"),
        "--schema", str(tmp_path / "s.toml"), "--out", str(tmp_path / "day2"),
        "--vocabulary-from", str(tmp_path / "day1")])
    assert result.exit_code == 0, result.output
    assert "event.btag: 1 out of vocabulary" in result.output
    day2 = pq.read_table(tmp_path / "day2" / "train-00000.parquet")
    assert day2.column("event.btag").to_pylist() == [[1, 5], []]
    info = json.loads((tmp_path / "day2" / "manifest.json").read_text())["info"]
    assert info["features"]["event.btag"]["out_of_vocabulary"] == 1
    assert info["vocabularies"]["btag"]["from"] == str(tmp_path / "day1")
    assert (tmp_path / "day2" / "vocabulary.btag.json").read_bytes() == path.read_bytes()
    # A changed vocabulary file is refused; a table too small for its vocabulary too.
    path.write_text(path.read_text().replace("cart", "cert"))
    with pytest.raises(GemDataError, match=r"vocabulary\.btag\.json: the vocabulary of table "
                                           r"'btag' differs from the one its manifest records"):
        import_logs(tmp_path / "imp.csv", tmp_path / "ev.csv", tmp_path / "s.toml",
                    tmp_path / "day3", vocabulary_from=tmp_path / "day1")
    write(tmp_path / "s.toml", VOCAB.replace("num_embeddings = 6", "num_embeddings = 5"))
    with pytest.raises(GemDataError, match=r"table 'btag' has num_embeddings = 5 but its "
                                           r"vocabulary needs 6 rows"):
        import_logs(tmp_path / "imp.csv", tmp_path / "ev.csv", tmp_path / "s.toml",
                    tmp_path / "day4")


# -- d. side tables ----------------------------------------------------------------------------

SIDE = ('tasks = ["click"]\n'
        '[[tables]]\nname = "ad"\nnum_embeddings = 1000\nid_policy = "hash"\n'
        '[[tables]]\nname = "cate"\nnum_embeddings = 10\n'
        '[[tables]]\nname = "age"\nnum_embeddings = 8\n'
        '[[event_features]]\nname = "ad"\ntable = "ad"\n'
        '[[event_features]]\nname = "cate"\ntable = "cate"\n'
        '[[candidate_features]]\nname = "ad"\ntable = "ad"\n'
        '[[candidate_features]]\nname = "cate"\ntable = "cate"\n'
        '[[sparse_features]]\nname = "age"\ntable = "age"\n'
        '[import]\neval_fraction = 0\n'
        '[[import.join]]\nfile = "ads.parquet"\nkey = "ad_id"\nlog = "impressions"\n'
        'log_key = "ad"\nfeatures = { "candidate.cate" = "category" }\n'
        '[[import.join]]\nfile = "ads.parquet"\nkey = "ad_id"\nlog = "events"\n'
        'log_key = "ad"\nfeatures = { "event.cate" = "category" }\n'
        '[[import.join]]\nfile = "users.csv"\nkey = "uid"\nlog = "impressions"\n'
        'log_key = "user_id"\nfeatures = { "sparse.age" = "age" }\n')
A, B = 2**63 + 1, 2**64 - 2  # ad ids above 2^63, which float64 cannot hold


def side_logs(tmp_path, ads=((A, 3), (B, 4)), users="uid,age\n1,5\n2,\n"):
    pq.write_table(pa.table({"ad_id": pa.array([a for a, _ in ads], pa.uint64()),
                             "category": [c for _, c in ads]}), tmp_path / "ads.parquet")
    write(tmp_path / "users.csv", users)
    write(tmp_path / "imp.csv", "user_id,request_id,timestamp,ad,click\n"
                                f"1,r1,100,{A},1\n1,r1,100,{B},0\n2,r2,200,{B},1\n3,r3,300,7,0\n")
    write(tmp_path / "ev.csv", f"user_id,timestamp,ad\n1,50,{B}\n2,60,7\n")


def test_side_tables_join_by_key_and_missing_keys_follow_the_policy(tmp_path):
    side_logs(tmp_path, users="uid,age\n1,5\n2,6\n")
    write(tmp_path / "s.toml", SIDE)
    schema, options = read_schema_file(tmp_path / "s.toml")
    # Under "error", the first row whose key is not in the side table stops the import.
    with pytest.raises(GemDataError, match=r"ev\.csv, line 3, column 'ad': key 7 is not in "
                                           r"side table .*ads\.parquet \(column 'ad_id'\), which "
                                           r"gives feature event\.cate \(1 such rows\)"):
        build_requests(tmp_path / "imp.csv", tmp_path / "ev.csv", schema, options)
    write(tmp_path / "s.toml", SIDE + '[import.features]\n"event.cate" = { missing = "drop" }\n')
    schema, options = read_schema_file(tmp_path / "s.toml")
    with pytest.raises(GemDataError, match=r"imp\.csv, line 5, column 'ad': key 7 is not in "
                                           r"side table .*ads\.parquet \(column 'ad_id'\), which "
                                           r"gives feature candidate\.cate \(1 such rows\)"):
        build_requests(tmp_path / "imp.csv", tmp_path / "ev.csv", schema, options)
    side_logs(tmp_path)
    write(tmp_path / "s.toml", SIDE + '[import.features]\n'
          '"candidate.cate" = { missing = "default", default = 0 }\n'
          '"event.cate" = { missing = "drop" }\n'
          '"sparse.age" = { missing = "default", default = 7 }\n')
    schema, options = read_schema_file(tmp_path / "s.toml")
    batch = build_requests(tmp_path / "imp.csv", tmp_path / "ev.csv", schema, options)["train"]
    assert candidates(batch, 0, "ad") == [signed(A), signed(B)]
    assert candidates(batch, 0, "cate") == [3, 4] and candidates(batch, 2, "cate") == [0]
    assert batch.sparse["age"].values.tolist() == [5, 7, 7]  # user 2: null age; 3: no row
    assert history(batch, 0, "cate") == ([4], [50])
    assert history(batch, 1, "ad") == ([], [])  # user 2's event (ad 7, no category) dropped


def test_side_table_problems_name_the_side_table(tmp_path):
    side_logs(tmp_path, ads=((A, 3), (B, 4), (A, 5)))
    write(tmp_path / "s.toml", SIDE)
    schema, options = read_schema_file(tmp_path / "s.toml")
    with pytest.raises(GemDataError, match=rf"ads\.parquet, row 2, column 'ad_id': key "
                                           rf"{signed(A)} appears again \(first on row 0; 1 "
                                           r"repeated keys\); a side table has one row per key"):
        build_requests(tmp_path / "imp.csv", tmp_path / "ev.csv", schema, options)
    side_logs(tmp_path, ads=((A, 3), (B, 14), (7, 1)), users="uid,age\n1,5\n2,6\n3,1\n")
    with pytest.raises(GemDataError, match=r"ads\.parquet, row 1, column 'category': id 14 is "
                                           r"outside \[0, 10\) of table 'cate'"):
        build_requests(tmp_path / "imp.csv", tmp_path / "ev.csv", schema, options)
    with pytest.raises(GemDataError, match=r"import\.join\[1\] \(ads\.parquet\): candidate\.cate "
                                           r"is a feature of the impressions log, but the join "
                                           r"has log = 'events'"):
        read_schema_file(write(tmp_path / "bad.toml", SIDE.replace(
            '"event.cate" = "category"', '"candidate.cate" = "category"')))


def test_context_that_varies_within_a_request_points_at_candidate_features(tmp_path):
    schema = BASE + ('[[tables]]\nname = "slot"\nnum_embeddings = 4\n'
                     '[[sparse_features]]\nname = "slot"\ntable = "slot"\n')
    with pytest.raises(GemDataError, match=r"imp\.csv, line 3, column 'slot': request \(user_id "
                                           r"1, timestamp 100\) has impressions with different "
                                           r"values of context feature 'slot' .*declare it under "
                                           r"\[\[candidate_features\]\] instead"):
        build(tmp_path, schema, "user_id,timestamp,ad,slot,click\n1,100,5,1,1\n1,100,6,2,0\n",
              "user_id,timestamp,ad\n1,50,9\n")
    as_candidate = BASE + ('[[tables]]\nname = "slot"\nnum_embeddings = 4\n'
                           '[[candidate_features]]\nname = "slot"\ntable = "slot"\n'
                           '[import]\neval_fraction = 0\n')
    batch = build(tmp_path, as_candidate, "user_id,timestamp,ad,slot,click\n1,100,5,1,1\n"
                  "1,100,6,2,0\n", "user_id,timestamp,ad\n1,50,9\n")["train"]
    assert candidates(batch, 0, "slot") == [1, 2]


# -- the docs/byod.md walkthrough: four Taobao-shaped tables ----------------------------------


def taobao_blocks() -> dict[str, list[str]]:
    blocks: dict[str, list[str]] = {}
    for name, body in re.findall(r"<!-- byod-taobao:(\S+) -->\n```\w*\n(.*?)```",
                                 DOC.read_text(), flags=re.S):
        blocks.setdefault(name, []).append(body)
    return blocks


def test_taobao_four_tables_import_with_one_schema_and_one_command(tmp_path, monkeypatch):
    from gem_data.cli import data_group

    blocks = taobao_blocks()
    for name in ("raw_sample.csv", "ad_feature.csv", "user_profile.csv", "behavior_log.csv",
                 "taobao.toml"):
        (tmp_path / name).write_text(blocks[name][0])
    assert "request_id" not in blocks["raw_sample.csv"][0]
    (command,) = [shlex.split(line) for line in blocks["command"][0].splitlines() if line]
    assert command[:3] == ["gem", "data", "import"]
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(import_command, command[3:])
    assert result.exit_code == 0, result.output
    printed = re.search(r"It prints:\n\n```\n(.*?)```", DOC.read_text(), flags=re.S).group(1)
    assert result.output == printed  # the page shows what the command prints
    assert CliRunner().invoke(data_group, ["validate", "taobao_data"]).exit_code == 0

    schema, options = read_schema_file("taobao.toml")
    splits = build_requests("raw_sample.csv", "behavior_log.csv", schema, options)
    train = splits["train"]
    # Requests: one user at one time_stamp; 581738 at 1494137644 has two candidates in two
    # slots (pid is a candidate feature) and one history event (the cart at the request
    # time is left out).
    assert train.request_timestamps.tolist()[0] == 1494137644
    assert candidates(train, 0, "adgroup_id") == [1, 2]
    assert candidates(train, 0, "pid") == [3, 2]  # vocabulary: 430539_1007 2, 430548_1007 3
    assert history(train, 0, "btag") == ([5], [1494137000])  # pv
    assert candidates(train, 0, "cate") == [6406, 4520]
    assert candidates(train, 0, "brand") == [95471, 247789]
    # Ad 3's NULL brand and ad 6 (not in ad_feature) get the default 0.
    rows = {int(t): i for i, t in enumerate(train.request_timestamps.tolist())}
    assert candidates(train, rows[1494638778], "brand") == [0]
    evaluation = splits["eval"]
    assert evaluation.request_timestamps.tolist() == [1494660000, 1494670000]
    assert candidates(evaluation, 0, "cate") == [0] and candidates(evaluation, 0, "brand") == [0]
    # Profiles: 581738 has no pvalue_level (0), 1141147 no profile at all (0 everywhere).
    assert train.sparse["pvalue"].values.tolist()[0] == 0
    assert train.sparse["age"].values.tolist()[0] == 5
    assert evaluation.sparse["gender"].values.tolist() == [2, 0]
    # The history: 914836's buy with no brand has brand 0; btag ids from the vocabulary.
    row = rows[1494651029]
    assert history(train, row, "btag") == ([2, 5], [1494650000, 1494651000])  # buy, pv
    assert history(train, row, "brand")[0] == [0, 247789]


def test_taobao_tables_as_parquet_give_the_same_requests(tmp_path):
    """The same four tables as Parquet (NULLs as nulls, integers as int64, strings as
    strings): identical requests, so strings, nulls and joins do not depend on the format."""
    blocks = taobao_blocks()
    for name in ("raw_sample", "ad_feature", "user_profile", "behavior_log"):
        (tmp_path / f"{name}.csv").write_text(blocks[f"{name}.csv"][0])
        pq.write_table(pacsv.read_csv(tmp_path / f"{name}.csv"), tmp_path / f"{name}.parquet")
    (tmp_path / "csv.toml").write_text(blocks["taobao.toml"][0])
    (tmp_path / "pq.toml").write_text(blocks["taobao.toml"][0].replace(".csv", ".parquet"))
    assert pq.read_table(tmp_path / "ad_feature.parquet").column("brand").null_count == 2
    results = []
    for kind, schema_file in (("csv", "csv.toml"), ("parquet", "pq.toml")):
        schema, options = read_schema_file(tmp_path / schema_file)
        results.append(build_requests(tmp_path / f"raw_sample.{kind}",
                                      tmp_path / f"behavior_log.{kind}", schema, options))
    from gem_data.arrow_io import batch_to_table

    for split in ("train", "eval"):
        assert batch_to_table(results[0][split], schema).equals(
            batch_to_table(results[1][split], schema)), split
