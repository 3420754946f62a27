"""``gem data import``: flat logs -> request-level rows, no leakage, clear errors, and the
docs/byod.md walkthrough run exactly as written."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from gem_core.errors import GemDataError
from gem_data.importer import ImportOptions, build_requests, import_command, read_schema_file

DOC = Path(__file__).resolve().parents[3] / "docs" / "byod.md"


def doc_blocks() -> dict[str, list[str]]:
    """The fenced blocks of docs/byod.md that follow a ``<!-- byod:NAME -->`` marker."""
    blocks: dict[str, list[str]] = {}
    for name, body in re.findall(r"<!-- byod:(\S+) -->\n```\w*\n(.*?)```", DOC.read_text(),
                                 flags=re.S):
        blocks.setdefault(name, []).append(body)
    return blocks


def write_doc_example(directory: Path) -> dict[str, list[str]]:
    blocks = doc_blocks()
    for name in ("impressions.csv", "events.csv", "schema.toml"):
        (directory / name).write_text(blocks[name][0])
    return blocks


def history(batch, row, feature="ad_id"):
    s, e = int(batch.seq_offsets[row]), int(batch.seq_offsets[row + 1])
    return batch.event_ids[feature][s:e].tolist(), batch.seq_timestamps[s:e].tolist()


def candidates(batch, row, feature="ad_id"):
    s, e = int(batch.candidate_offsets[row]), int(batch.candidate_offsets[row + 1])
    return batch.candidate_ids[feature][s:e].tolist()


def test_doc_example_in_memory(tmp_path):
    write_doc_example(tmp_path)
    schema, options = read_schema_file(tmp_path / "schema.toml")
    assert options.eval_fraction == 0.25 and schema.table("ad").id_policy == "hash"
    splits = build_requests(tmp_path / "impressions.csv", tmp_path / "events.csv", schema,
                            options)
    train, evaluation = splits["train"], splits["eval"]
    for batch in splits.values():
        batch.validate(schema)
    # Requests in time order: r1 (1000), r2 (1100), r3 (2000) train; r4 (2100), r4b eval.
    assert train.request_timestamps.tolist() == [1000, 1100, 2000]
    assert evaluation.request_timestamps.tolist() == [2100, 2200]
    assert candidates(train, 0) == [9001, 9002] and candidates(train, 2) == [9004, 9001]
    assert train.labels["click"].tolist() == [1, 0, 0, 1, 0]
    assert train.labels["conversion"].tolist() == [0, 0, 0, 1, 0]
    # r1 at time 1000: the click at exactly 1000 (its own outcome) is not in the history.
    assert history(train, 0) == ([9002, 9001], [900, 950])
    assert history(train, 2) == ([9002, 9001, 9001, 9004], [900, 950, 1000, 1500])
    assert history(evaluation, 1) == ([], [])  # u3 has no events
    topics = train.candidate_ids["topics"]
    assert topics.values.tolist() == [1, 2, 2, 1, 2, 3, 1, 2]
    assert topics.offsets.tolist() == [0, 2, 3, 4, 6, 8]
    assert train.sparse["surface"].values.tolist() == [0, 1, 0]
    # Users keep one number per user (the hash of their text when ids are text).
    assert train.user_ids.tolist()[0] == train.user_ids.tolist()[2]


def test_doc_walkthrough_end_to_end(tmp_path, monkeypatch):
    """The commands of docs/byod.md, run as written (import, then validate)."""
    from gem_data.cli import data_group

    blocks = write_doc_example(tmp_path)
    monkeypatch.chdir(tmp_path)
    commands = [shlex.split(line) for body in blocks["command"] for line in body.splitlines()
                if line.strip()]
    assert [c[:3] for c in commands] == [["gem", "data", "import"], ["gem", "data", "validate"]]
    runner = CliRunner()
    result = runner.invoke(import_command, commands[0][3:])
    assert result.exit_code == 0, result.output
    assert "3 train + 2 eval requests" in result.output
    result = runner.invoke(data_group, commands[1][2:])
    assert result.exit_code == 0, result.output
    from gem_data.manifest import read_manifest

    manifest = read_manifest(tmp_path / "my_data")
    assert manifest.rows("train") == 3 and manifest.rows("eval") == 2


def test_no_leakage_from_the_impressions_own_outcome(tmp_path):
    """Every clicked impression's click is also logged as an event at the request time. With
    histories strictly before the request, the history says nothing about the label: the
    share of requests whose last history event is a click on the candidate is the same for
    clicked and not clicked impressions; with the event included it would give the label."""
    rng = np.random.default_rng(0)
    n_users, n_requests = 40, 400
    user = rng.integers(0, n_users, n_requests)
    when = np.sort(rng.choice(np.arange(1_000, 1_000_000), n_requests, replace=False))
    ad = rng.integers(0, 20, n_requests)
    click = rng.random(n_requests) < 0.5
    impressions = pa.table({"user_id": user, "request_id": np.arange(n_requests),
                            "timestamp": when, "ad_id": ad, "click": click.astype(np.int64)})
    # Event log: each click at exactly its request's time, plus unrelated earlier views.
    views = rng.integers(0, n_requests, 300)
    events = pa.table({
        "user_id": np.r_[user[click], user[views]],
        "timestamp": np.r_[when[click], when[views] - rng.integers(1, 500, views.size)],
        "ad_id": np.r_[ad[click], rng.integers(0, 20, views.size)],
        "action": np.r_[np.ones(int(click.sum()), dtype=np.int64),
                        np.zeros(views.size, dtype=np.int64)]})
    pq.write_table(impressions, tmp_path / "imp.parquet")
    pq.write_table(events, tmp_path / "ev.parquet")
    (tmp_path / "schema.toml").write_text(
        'tasks = ["click"]\nmax_seq_len = 64\n'
        '[[tables]]\nname = "ad"\nnum_embeddings = 20\n'
        '[[tables]]\nname = "action"\nnum_embeddings = 2\n'
        '[[event_features]]\nname = "ad_id"\ntable = "ad"\n'
        '[[event_features]]\nname = "action"\ntable = "action"\n'
        '[[candidate_features]]\nname = "ad_id"\ntable = "ad"\n'
        '[import]\neval_fraction = 0.0\n')
    schema, options = read_schema_file(tmp_path / "schema.toml")
    batch = build_requests(tmp_path / "imp.parquet", tmp_path / "ev.parquet", schema,
                           options)["train"]
    batch.validate(schema)
    assert batch.batch_size == n_requests
    rows = torch.repeat_interleave(torch.arange(batch.batch_size), batch.seq_lengths())
    assert bool((batch.seq_timestamps < batch.request_timestamps[rows]).all())
    # Histories are exactly the user's events strictly earlier (checked by brute force).
    ev_user, ev_time = events.column("user_id").to_numpy(), events.column("timestamp").to_numpy()
    order = np.argsort(when, kind="stable")
    for row in range(0, n_requests, 37):
        r = order[row]
        expected = np.sort(ev_time[(ev_user == user[r]) & (ev_time < when[r])])[-64:]
        assert history(batch, row)[1] == expected.tolist()
    # The last history event is a click on the candidate's ad: no better than chance.
    last_click_on_candidate = []
    for row in range(batch.batch_size):
        s, e = int(batch.seq_offsets[row]), int(batch.seq_offsets[row + 1])
        last_click_on_candidate.append(
            e > s and int(batch.event_ids["action"][e - 1]) == 1
            and int(batch.event_ids["ad_id"][e - 1]) == int(batch.candidate_ids["ad_id"][row]))
    leak = np.array(last_click_on_candidate)
    label = batch.labels["click"].numpy() == 1
    assert abs(leak[label].mean() - leak[~label].mean()) < 0.05


def test_parquet_lists_and_hashed_uint64_ids(tmp_path):
    big = np.array([2**64 - 1, 2**63, 12345], dtype=np.uint64)
    impressions = pa.table({
        "uid": pa.array(["a", "a", "b"]), "req": pa.array([7, 7, 8]),
        "ts": pa.array(np.array([10, 10, 20]) * 10**9, pa.timestamp("ns")),
        "creative": pa.array(big), "is_click": pa.array([True, False, True]),
        "genres": pa.array([[1, 2], [3], [0]], pa.list_(pa.int64())),
        "d0": pa.array([0.5, 0.5, -1.0]), "d1": pa.array([1, 1, 2])})
    events = pa.table({
        "uid": pa.array(["a", "b", "b"]),
        "ts": pa.array(np.array([5, 19, 20]) * 10**9, pa.timestamp("ns")),
        "creative": pa.array(big[[2, 0, 1]]),
        "genres": pa.array([[1], [2, 3], [0]], pa.list_(pa.int64()))})
    pq.write_table(impressions, tmp_path / "imp.parquet")
    pq.write_table(events, tmp_path / "ev.parquet")
    (tmp_path / "schema.toml").write_text(
        'tasks = ["click"]\nnum_dense = 2\n'
        '[[tables]]\nname = "ad"\nnum_embeddings = 1000\nid_policy = "hash"\n'
        '[[tables]]\nname = "genre"\nnum_embeddings = 4\n'
        '[[event_features]]\nname = "ad"\ntable = "ad"\n'
        '[[event_features]]\nname = "genres"\ntable = "genre"\nmulti_valued = true\n'
        '[[candidate_features]]\nname = "ad"\ntable = "ad"\n'
        '[[candidate_features]]\nname = "genres"\ntable = "genre"\nmulti_valued = true\n'
        '[import]\nuser_column = "uid"\nrequest_column = "req"\ntimestamp_column = "ts"\n'
        'dense_columns = ["d0", "d1"]\neval_fraction = 0.0\n'
        '[import.columns]\n"event.ad" = "creative"\n"candidate.ad" = "creative"\n'
        '"label.click" = "is_click"\n')
    schema, options = read_schema_file(tmp_path / "schema.toml")
    batch = build_requests(tmp_path / "imp.parquet", tmp_path / "ev.parquet", schema,
                           options)["train"]
    batch.validate(schema)
    signed = big.view(np.int64).tolist()
    assert batch.candidate_ids["ad"].tolist() == signed
    assert batch.request_timestamps.tolist() == [10, 20]
    assert history(batch, 0, "ad") == ([signed[2]], [5])
    assert history(batch, 1, "ad") == ([signed[0]], [19])  # the event at 20 is excluded
    assert batch.candidate_ids["genres"].values.tolist() == [1, 2, 3, 0]
    assert batch.dense.tolist() == [[0.5, 1.0], [-1.0, 2.0]]
    assert batch.labels["click"].tolist() == [1.0, 0.0, 1.0]


def test_history_is_truncated_to_the_most_recent(tmp_path):
    (tmp_path / "imp.csv").write_text("user_id,request_id,timestamp,item,click\n"
                                      "1,r,100,5,1\n")
    (tmp_path / "ev.csv").write_text("user_id,timestamp,item\n"
                                     + "".join(f"1,{t},{t % 10}\n" for t in range(50, 0, -1)))
    (tmp_path / "s.toml").write_text(
        'tasks = ["click"]\nmax_seq_len = 3\n[[tables]]\nname = "item"\nnum_embeddings = 10\n'
        '[[event_features]]\nname = "item"\ntable = "item"\n'
        '[[candidate_features]]\nname = "item"\ntable = "item"\n[import]\neval_fraction = 0\n')
    schema, options = read_schema_file(tmp_path / "s.toml")
    batch = build_requests(tmp_path / "imp.csv", tmp_path / "ev.csv", schema, options)["train"]
    assert history(batch, 0, "item") == ([8, 9, 0], [48, 49, 50])


BAD_CASES = [
    # (impressions csv, message pattern)
    ("user_id,request_id,timestamp,ad_id,advertiser,topics,click,conversion,surface\n"
     "u1,r1,1000,9001,3,1|2,1,0,0\nu1,r1,1000,9002,4,2,,0,0\n",
     r"imp\.csv, line 3, column 'click': missing value \(label of task 'click'"),
    ("user_id,request_id,timestamp,ad_id,advertiser,topics,click,conversion,surface\n"
     "u1,r1,1000,9001,3,1|2,2,0,0\n",
     r"imp\.csv, line 2, column 'click': label 2\.0 of task 'click' is not 0 or 1"),
    ("user_id,request_id,timestamp,ad_id,advertiser,topics,click,conversion\n"
     "u1,r1,1000,9001,3,1|2,1,0\n",
     r"imp\.csv: the impression log has no column 'surface' \(context feature 'surface'\); "
     r"its columns: user_id, request_id"),
    ("user_id,request_id,timestamp,ad_id,advertiser,topics,click,conversion,surface\n"
     "u1,r1,1000,9001,3,1|2,1,0,0\nu1,r1,1000,9002,12,2,0,0,0\n",
     r"imp\.csv, line 3, column 'advertiser': id 12 is outside \[0, 10\) of table "
     r"'advertiser'"),
    ("user_id,request_id,timestamp,ad_id,advertiser,topics,click,conversion,surface\n"
     "u1,r1,1000,9001,3,1|2,1,0,0\nu2,r1,1000,9002,4,2,0,0,0\n",
     r"imp\.csv, line 3, column 'user_id': request 'r1' has impressions with different users"),
    ("user_id,request_id,timestamp,ad_id,advertiser,topics,click,conversion,surface\n"
     "u1,r1,1000,9001,3,1|x,1,0,0\n",
     r"imp\.csv, line 2, column 'topics': candidate feature 'topics': 'x' is not an integer"),
]


@pytest.mark.parametrize("impressions,pattern", BAD_CASES)
def test_bad_input_names_file_row_and_column(tmp_path, impressions, pattern):
    write_doc_example(tmp_path)
    (tmp_path / "imp.csv").write_text(impressions)
    schema, options = read_schema_file(tmp_path / "schema.toml")
    with pytest.raises(GemDataError, match=pattern):
        build_requests(tmp_path / "imp.csv", tmp_path / "events.csv", schema, options)


def test_bad_event_log_and_schema(tmp_path):
    write_doc_example(tmp_path)
    (tmp_path / "ev.csv").write_text("user_id,timestamp,ad_id,advertiser,topics,action\n"
                                     "u1,900,9002,4,,0\n")
    schema, options = read_schema_file(tmp_path / "schema.toml")
    with pytest.raises(GemDataError, match=r"ev\.csv, line 2, column 'topics': missing value"):
        build_requests(tmp_path / "impressions.csv", tmp_path / "ev.csv", schema, options)
    (tmp_path / "bad.toml").write_text('tasks = ["click"]\n[[tables]]\nname = "a"\n')
    with pytest.raises(GemDataError, match=r"bad\.toml: .*tables\[0\]"):
        read_schema_file(tmp_path / "bad.toml")
    (tmp_path / "bad2.toml").write_text(
        (tmp_path / "schema.toml").read_text() + 'colums = 3\n')
    with pytest.raises(GemDataError, match=r"unknown key 'import.colums'"):
        read_schema_file(tmp_path / "bad2.toml")
    with pytest.raises(GemDataError, match=r"unknown file type '.json'"):
        build_requests(tmp_path / "x.json", tmp_path / "ev.csv", schema, ImportOptions())
