"""``gem data import --engine numpy|duckdb`` (issue #28, item 1): DuckDB writes the requests the
numpy path writes (row for row, every column, the same split: byte-identical files) on the same
logs, read in blocks of a few rows so that every rule meets block boundaries; its errors are the
numpy path's; ``--memory-limit`` reaches DuckDB; ``gem bench import`` runs both."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from gem_core.errors import GemDataError
from gem_data.importer import import_command, import_logs
from gem_data.testing import hashed_log_schema

pytest.importorskip("duckdb")

DOC = Path(__file__).resolve().parents[3] / "docs" / "byod.md"
BIG = [2**64 - 1, 2**62 + 3, 2**53 + 1, 2**63]
# Blocks of a few rows (Parquet) or bytes (CSV): every block boundary is crossed.
SMALL_BLOCKS = {"block_rows": 5, "block_bytes": 160}


def signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def both(tmp_path: Path, imp: Path, ev: Path, schema_file: Path, *, blocks: dict | None = None,
         **options):
    """Import with each engine; assert the data files are identical and the reports agree."""
    manifests = {}
    for engine in ("numpy", "duckdb"):
        extra = dict(SMALL_BLOCKS if blocks is None else blocks) if engine == "duckdb" else {}
        manifests[engine] = import_logs(imp, ev, schema_file, tmp_path / engine, engine=engine,
                                        **extra, **options)
    a, b = manifests["numpy"], manifests["duckdb"]
    assert set(a.splits) == set(b.splits)
    for split in a.splits:
        (fa,), (fb,) = a.splits[split], b.splits[split]
        ta = pq.read_table(tmp_path / "numpy" / fa.path)
        tb = pq.read_table(tmp_path / "duckdb" / fb.path)
        for column in ta.column_names:
            assert ta.column(column).to_pylist() == tb.column(column).to_pylist(), \
                (split, column)
        assert (fa.rows, fa.row_groups, fa.tokens, fa.candidates) == \
            (fb.rows, fb.row_groups, fb.tokens, fb.candidates)
        assert fa.sha256 == fb.sha256, split  # byte for byte
    for key in ("split", "requests", "features", "vocabularies"):
        assert a.info[key] == b.info[key], key
    assert a.info["engine"] == {"name": "numpy"} and b.info["engine"]["name"] == "duckdb"
    assert sorted(p.name for p in (tmp_path / "duckdb").iterdir()) == \
        sorted(p.name for p in (tmp_path / "numpy").iterdir())  # no work files left
    return a, b


# -- generated logs: 64-bit ids, lists, ties, empty histories, events at the request time -----

SCHEMA = hashed_log_schema(max_seq_len=4, eval_fraction=0.25)
USERS = [2**64 - 1, 2**62 + 3, 5, 7, 2**63, 11, 13, 17]  # the last two have no events


def generated_logs(tmp_path: Path, kind: str, *, request_id: bool = True, seed: int = 3):
    rng = np.random.default_rng(seed)
    ids = BIG + [1, 2, 3]
    pairs = sorted({(int(u), int(t)) for u, t in zip(rng.integers(0, len(USERS), 60),
                                                     rng.choice([100, 200, 300, 400], 60))})
    imp_rows, ev_rows = [], []
    for r, (u, t) in enumerate(pairs):
        seg = [ids[int(i)] for i in rng.integers(0, len(ids), int(rng.integers(1, 3)))]
        score = float(rng.integers(0, 4)) / 2
        for _ in range(int(rng.integers(1, 4))):
            topics = [ids[int(i)] for i in rng.integers(0, len(ids), int(rng.integers(1, 4)))]
            imp_rows.append((USERS[u], f"r{r}", t, ids[int(rng.integers(0, len(ids)))], topics,
                             seg, score, int(rng.integers(0, 2))))
        if u < 6:  # an event at exactly the request time: not in the history
            ev_rows.append((USERS[u], t, ids[0], [ids[1]]))
    order = rng.permutation(len(imp_rows))  # impressions of a request are not adjacent
    imp_rows = [imp_rows[i] for i in order]
    for _ in range(70):
        ev_rows.append((USERS[int(rng.integers(0, 6))], int(rng.choice(range(50, 450, 25))),
                        ids[int(rng.integers(0, len(ids)))],
                        [ids[int(i)] for i in rng.integers(0, len(ids), int(rng.integers(1, 3)))]))
    imp_cols = ["user_id", "request_id", "timestamp", "ad", "topics", "seg", "score", "click"]
    ev_cols = ["user_id", "timestamp", "ad", "topics"]
    if not request_id:
        imp_cols.remove("request_id")
        imp_rows = [row[:1] + row[2:] for row in imp_rows]
    if kind == "csv":
        def cell(v):
            return "|".join(map(str, v)) if isinstance(v, list) else str(v)
        for name, cols, rows in (("imp", imp_cols, imp_rows), ("ev", ev_cols, ev_rows)):
            (tmp_path / f"{name}.csv").write_text(",".join(cols) + "\n" + "".join(
                ",".join(cell(v) for v in row) + "\n" for row in rows))
    else:
        u64, lu64 = pa.uint64(), pa.list_(pa.uint64())
        types = {"user_id": u64, "ad": u64, "topics": lu64, "seg": lu64}
        for name, cols, rows in (("imp", imp_cols, imp_rows), ("ev", ev_cols, ev_rows)):
            pq.write_table(pa.table({c: pa.array([row[i] for row in rows], types.get(c))
                                     for i, c in enumerate(cols)}), tmp_path / f"{name}.{kind}")
    (tmp_path / "s.toml").write_text(SCHEMA)
    return tmp_path / f"imp.{kind}", tmp_path / f"ev.{kind}", tmp_path / "s.toml"


@pytest.mark.parametrize("kind", ["csv", "parquet"])
@pytest.mark.parametrize("request_id", [True, False], ids=["request_id", "user_and_time"])
def test_engines_write_identical_requests(tmp_path, kind, request_id):
    imp, ev, schema_file = generated_logs(tmp_path, kind, request_id=request_id)
    a, _ = both(tmp_path, imp, ev, schema_file)
    # The logs exercise what they are meant to: 64-bit ids, empty and truncated histories,
    # events at the request time left out, a tie at the cut kept on one side.
    assert a.info["split"]["tie_at_cut"]["requests"] > 1
    assert a.info["requests"]["key"] == (["request_id"] if request_id
                                         else ["user_id", "timestamp"])
    table = pa.concat_tables(pq.read_table(tmp_path / "numpy" / f"{s}-00000.parquet")
                             for s in ("train", "eval"))
    lengths = [len(h) for h in table.column("history_timestamp").to_pylist()]
    assert 0 in lengths and 4 in lengths
    assert set(table.column("user_id").to_pylist()) >= {signed(2**64 - 1), 2**62 + 3}
    flat = [i for c in table.column("candidate.topics").to_pylist() for t in c for i in t]
    assert signed(2**64 - 1) in flat and 2**62 + 3 in flat
    for stamps, when in zip(table.column("history_timestamp").to_pylist(),
                            table.column("request_timestamp").to_pylist()):
        assert all(s < when for s in stamps)


def test_a_text_key_column_is_numbers_only_if_every_block_agrees(tmp_path):
    """A CSV user column with -5 in one block and 2^64 - 1 in another is neither int64 nor
    uint64 as a whole: text (users numbered by the hash of their text), as the numpy path reads
    it; blocks of small numbers and blocks of 2^63 and more are uint64 as a whole."""
    from gem_data.import_strings import string_id

    schema = ('tasks = ["click"]\n[[tables]]\nname = "ad"\nnum_embeddings = 10\n'
              '[[event_features]]\nname = "ad"\ntable = "ad"\n'
              '[[candidate_features]]\nname = "ad"\ntable = "ad"\n[import]\neval_fraction = 0\n')
    (tmp_path / "s.toml").write_text(schema)
    for name, users in (("mixed", ["-5", "3", str(2**64 - 1)]),
                        ("unsigned", ["5", "3", str(2**63)])):
        work = tmp_path / name
        work.mkdir()
        rows = "".join(f"{u},{i},{100 + i},1,{i % 2}\n" for i, u in enumerate(users * 4))
        (work / "imp.csv").write_text("user_id,request_id,timestamp,ad,click\n" + rows)
        (work / "ev.csv").write_text("user_id,timestamp,ad\n" + "".join(
            f"{u},{50 + i},{i % 10}\n" for i, u in enumerate(users * 3)))
        a, _ = both(work, work / "imp.csv", work / "ev.csv", tmp_path / "s.toml",
                    blocks={"block_bytes": 48})
        user_ids = pq.read_table(work / "numpy" / "train-00000.parquet").column("user_id")
        expected = [string_id(u) for u in users] if name == "mixed" else \
            [5, 3, signed(2**63)]
        assert user_ids.to_pylist()[:3] == expected, name


# -- the options of issue #28 item 2 -----------------------------------------------------------


def taobao_blocks() -> dict[str, str]:
    return {name: body for name, body in re.findall(
        r"<!-- byod-taobao:(\S+) -->\n```\w*\n(.*?)```", DOC.read_text(), flags=re.S)}


def test_engines_agree_on_the_taobao_walkthrough(tmp_path, monkeypatch):
    """No request id, side tables, vocabularies, NULLs given defaults: the same requests and
    the same printed report as the page shows."""
    blocks = taobao_blocks()
    for name in ("raw_sample.csv", "ad_feature.csv", "user_profile.csv", "behavior_log.csv",
                 "taobao.toml"):
        (tmp_path / name).write_text(blocks[name])
    both(tmp_path, tmp_path / "raw_sample.csv", tmp_path / "behavior_log.csv",
         tmp_path / "taobao.toml", blocks={"block_bytes": 200})
    monkeypatch.chdir(tmp_path)
    command = blocks["command"].split()[3:]
    result = CliRunner().invoke(import_command, command + ["--engine", "duckdb"])
    assert result.exit_code == 0, result.output
    printed = re.search(r"It prints:\n\n```\n(.*?)```", DOC.read_text(), flags=re.S).group(1)
    assert result.output == printed


MISSING = ('tasks = ["click"]\nnum_dense = 1\n'
           '[[tables]]\nname = "ad"\nnum_embeddings = 100\nid_policy = "hash"\n'
           '[[tables]]\nname = "topic"\nnum_embeddings = 10\n'
           '[[tables]]\nname = "tag"\nnum_embeddings = 1000\nid_policy = "hash"\n'
           '[[tables]]\nname = "btag"\nnum_embeddings = 8\n'
           '[[tables]]\nname = "seg"\nnum_embeddings = 10\n'
           '[[event_features]]\nname = "ad"\ntable = "ad"\n'
           '[[event_features]]\nname = "topics"\ntable = "topic"\nmulti_valued = true\n'
           '[[event_features]]\nname = "btag"\ntable = "btag"\n'
           '[[candidate_features]]\nname = "ad"\ntable = "ad"\n'
           '[[candidate_features]]\nname = "tags"\ntable = "tag"\nmulti_valued = true\n'
           '[[sparse_features]]\nname = "seg"\ntable = "seg"\n'
           '[import]\neval_fraction = 0.3\ndense_columns = ["score"]\n'
           '[import.strings]\ntag = "hash"\nbtag = "vocabulary"\n'
           '[import.features]\n'
           '"event.ad" = { missing = "default", default = 99 }\n'
           '"event.topics" = { missing = "drop" }\n'
           '"event.btag" = { missing = "default" }\n'
           '"candidate.ad" = { missing = "drop" }\n'
           '"candidate.tags" = { missing = "default", default = 0 }\n'
           '"sparse.seg" = { missing = "default", default = 0 }\n'
           '"dense.score" = { missing = "default", default = -1.5 }\n')


def test_engines_agree_on_missing_policies_strings_and_reused_vocabularies(tmp_path):
    big = 2**63 + 5
    pq.write_table(pa.table({
        "user_id": ["a", "a", "b", "c", "c", "d", "a"],
        "timestamp": [100, 100, 200, 300, 300, 400, 500],
        "ad": pa.array([5, None, 6, None, 7, 8, 9], pa.int64()),
        "tags": pa.array([["café", "x"], ["y"], None, ["x"], [], ["z", None], ["x"]]),
        "seg": pa.array([[1], [1], None, [2], [2], [3, 4], [1]], pa.list_(pa.int64())),
        "score": pa.array([0.5, 0.5, None, 1.0, 1.0, 2.0, 0.5]),
        "click": [1, 0, 1, 0, 1, 1, 0]}), tmp_path / "imp.parquet")
    pq.write_table(pa.table({
        "user_id": ["a", "a", "a", "b", "c", "c", "a", "e"],
        "timestamp": [10, 20, 100, 150, 250, 300, 450, 60],
        "ad": pa.array([big, None, 3, 4, None, 6, 7, 8], pa.uint64()),
        "topics": pa.array([[1, None, 2], [None], [3], [], [4], [5, 6], [7], [8]],
                           pa.list_(pa.int64())),
        "btag": ["pv", None, "buy", "cart", "pv", "fav", "pv", "buy"]}), tmp_path / "ev.parquet")
    (tmp_path / "s.toml").write_text(MISSING)
    a, _ = both(tmp_path, tmp_path / "imp.parquet", tmp_path / "ev.parquet", tmp_path / "s.toml",
                blocks={"block_rows": 2})
    assert a.info["requests"]["dropped_impressions"] == 2
    assert a.info["features"]["event.topics"]["null_ids_removed"] == 2
    assert a.info["vocabularies"]["btag"]["values"] == 4
    # A later import reusing the vocabularies: unknown values counted the same.
    pq.write_table(pa.table({"user_id": ["a"], "timestamp": [30], "ad": pa.array([1], pa.uint64()),
                             "topics": pa.array([[1]], pa.list_(pa.int64())),
                             "btag": ["share"]}), tmp_path / "ev2.parquet")
    later = tmp_path / "later"
    later.mkdir()
    a, _ = both(later, tmp_path / "imp.parquet", tmp_path / "ev2.parquet", tmp_path / "s.toml",
                vocabulary_from=tmp_path / "numpy")
    assert a.info["features"]["event.btag"]["out_of_vocabulary"] == 1


def test_engines_agree_on_side_tables_with_64_bit_keys(tmp_path):
    A, B = 2**63 + 1, 2**64 - 2
    pq.write_table(pa.table({"ad_id": pa.array([A, B, 3], pa.uint64()),
                             "category": [3, 4, 5]}), tmp_path / "ads.parquet")
    (tmp_path / "users.csv").write_text("uid,age,income\n1,5,1.5\n2,,\n")
    (tmp_path / "imp.csv").write_text("user_id,timestamp,ad,click\n" + "".join(
        f"{u},{t},{ad},{i % 2}\n" for i, (u, t, ad) in enumerate(
            [(1, 100, A), (1, 100, B), (2, 200, B), (3, 300, 7), (2, 300, 3), (1, 400, A)])))
    (tmp_path / "ev.csv").write_text(f"user_id,timestamp,ad\n1,50,{B}\n2,60,7\n1,100,{A}\n"
                                     f"2,250,3\n")
    (tmp_path / "s.toml").write_text(
        'tasks = ["click"]\nnum_dense = 1\n'
        '[[tables]]\nname = "ad"\nnum_embeddings = 1000\nid_policy = "hash"\n'
        '[[tables]]\nname = "cate"\nnum_embeddings = 10\n'
        '[[tables]]\nname = "age"\nnum_embeddings = 8\n'
        '[[event_features]]\nname = "ad"\ntable = "ad"\n'
        '[[event_features]]\nname = "cate"\ntable = "cate"\n'
        '[[candidate_features]]\nname = "ad"\ntable = "ad"\n'
        '[[candidate_features]]\nname = "cate"\ntable = "cate"\n'
        '[[sparse_features]]\nname = "age"\ntable = "age"\n'
        '[import]\neval_fraction = 0.25\ndense_columns = ["income"]\n'
        '[[import.join]]\nfile = "ads.parquet"\nkey = "ad_id"\nlog = "impressions"\n'
        'log_key = "ad"\nfeatures = { "candidate.cate" = "category" }\n'
        '[[import.join]]\nfile = "ads.parquet"\nkey = "ad_id"\nlog = "events"\n'
        'log_key = "ad"\nfeatures = { "event.cate" = "category" }\n'
        '[[import.join]]\nfile = "users.csv"\nkey = "uid"\nlog = "impressions"\n'
        'log_key = "user_id"\nfeatures = { "sparse.age" = "age", "dense.income" = '
        '"income" }\n[import.features]\n"candidate.cate" = { missing = "default", default = 0 }\n'
        '"event.cate" = { missing = "drop" }\n"sparse.age" = { missing = "default", '
        'default = 7 }\n"dense.income" = { missing = "default", default = -1.0 }\n')
    a, _ = both(tmp_path, tmp_path / "imp.csv", tmp_path / "ev.csv", tmp_path / "s.toml",
                blocks={"block_bytes": 40})
    assert a.info["features"]["candidate.cate"]["not_in_side_table"] == 1
    # A dense feature from a side table: the user's value, or the default (null, no row).
    # (Before, the numpy path gathered the side table's rows twice: user 2 got user 1's 1.5.)
    dense = [v for split in ("train", "eval") for v in pq.read_table(
        tmp_path / "numpy" / f"{split}-00000.parquet").column("dense").to_pylist()]
    assert dense == [[1.5], [-1.0], [-1.0], [-1.0], [1.5]]


# -- errors: the numpy path's, from DuckDB too ---------------------------------------------------

RULES = ('tasks = ["click"]\nnum_dense = 1\n[[tables]]\nname = "ad"\nnum_embeddings = 10\n'
         '[[tables]]\nname = "surface"\nnum_embeddings = 4\n'
         '[[event_features]]\nname = "ad"\ntable = "ad"\n'
         '[[candidate_features]]\nname = "ad"\ntable = "ad"\n'
         '[[sparse_features]]\nname = "surface"\ntable = "surface"\n'
         '[import]\ndense_columns = ["price"]\n')
HEADER = "user_id,request_id,timestamp,ad,surface,price,click\n"
GOOD = "u1,r1,10,1,2,0.5,1\nu1,r2,20,3,1,1.0,0\nu2,r3,30,2,1,1.0,0\nu1,r1,10,2,2,0.5,0\n"
BAD_CASES = {
    "missing label": GOOD + "u2,r4,40,2,1,1.0,\n",
    "label not 0 or 1": GOOD + "u2,r4,40,2,1,1.0,2\n",
    "id outside its table": GOOD + "u2,r4,40,12,1,1.0,1\n",
    "id not an integer": GOOD + "u2,r4,40,1e3,1,1.0,1\n",
    "id beyond 64 bits": GOOD + f"u2,r4,40,{2**64},1,1.0,1\n",
    "time before the floor": GOOD + "u2,r4,-3,2,1,1.0,1\n",
    "users differ in a request": GOOD + "u2,r1,10,2,2,0.5,1\nu3,r1,10,2,2,0.5,1\n",
    "times differ in a request": GOOD + "u1,r1,11,2,2,0.5,1\n",
    "context differs in a request": GOOD + "u1,r2,20,2,3,1.0,1\nu1,r2,20,2,0,1.0,1\n",
    "context bag sizes differ": GOOD.replace("u1,r1,10,2,2,", 'u1,r1,10,2,"2|2",'),
    "dense differs in a request": GOOD + "u2,r3,30,2,1,1.5,1\n",
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_errors_are_the_numpy_paths(tmp_path, case):
    (tmp_path / "s.toml").write_text(RULES)
    (tmp_path / "imp.csv").write_text(HEADER + BAD_CASES[case])
    (tmp_path / "ev.csv").write_text("user_id,timestamp,ad\nu1,5,1\nu2,6,2\n")
    messages = {}
    for engine in ("numpy", "duckdb"):
        with pytest.raises(GemDataError) as error:
            import_logs(tmp_path / "imp.csv", tmp_path / "ev.csv", tmp_path / "s.toml",
                        tmp_path / engine, engine=engine)
        messages[engine] = str(error.value)
        assert not (tmp_path / engine).exists()
    assert messages["duckdb"] == messages["numpy"]
    assert str(tmp_path / "imp.csv") in messages["numpy"] and "line" in messages["numpy"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_two_keys_with_one_request_id_are_refused_by_both_engines(tmp_path, monkeypatch):
    from gem_data import import_requests

    (tmp_path / "s.toml").write_text(RULES.replace("[import]\n", "[import]\nrequest_columns = "
                                                                 '["user_id", "timestamp"]\n'))
    (tmp_path / "imp.csv").write_text(HEADER + GOOD)
    (tmp_path / "ev.csv").write_text("user_id,timestamp,ad\nu1,5,1\n")
    monkeypatch.setattr(import_requests, "_splitmix", lambda v: v * 0)
    messages = []
    for engine in ("numpy", "duckdb"):
        with pytest.raises(GemDataError, match="have the same 64-bit request id 0") as error:
            import_logs(tmp_path / "imp.csv", tmp_path / "ev.csv", tmp_path / "s.toml",
                        tmp_path / engine, engine=engine)
        messages.append(str(error.value))
    assert messages[0] == messages[1]


# -- DuckDB's memory limit and its options ---------------------------------------------------


def run_import(*arguments: str):
    return CliRunner().invoke(import_command, list(arguments))


def test_memory_limit_reaches_duckdb_and_a_tiny_one_is_a_clear_error(tmp_path):
    from gem_data.bench_import import write_logs

    imp, ev, schema_file = write_logs(tmp_path / "logs", 3000, 20000, users=150)
    spill = tmp_path / "spill"
    reference = import_logs(imp, ev, schema_file, tmp_path / "numpy")
    result = run_import("--impressions", str(imp), "--events", str(ev), "--schema",
                        str(schema_file), "--out", str(tmp_path / "out"), "--engine", "duckdb",
                        "--memory-limit", "100MB", "--temp-dir", str(spill))
    assert result.exit_code == 0, result.output
    info = json.loads((tmp_path / "out" / "manifest.json").read_text())["info"]
    assert info["engine"]["memory_limit"] in ("95.3 MiB", "95.3MiB")
    assert list(spill.iterdir()) == []  # the work directory is removed afterwards
    assert {s: [f["sha256"] for f in e["files"]] for s, e in
            json.loads((tmp_path / "out" / "manifest.json").read_text())["splits"].items()} == \
        {s: [f.sha256 for f in files] for s, files in reference.splits.items()}
    result = run_import("--impressions", str(imp), "--events", str(ev), "--schema",
                        str(schema_file), "--out", str(tmp_path / "tiny"), "--engine", "duckdb",
                        "--memory-limit", "1MB")
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and not isinstance(result.exception, AssertionError)
    assert re.search(r"Error: DuckDB ran out of memory under its memory limit \(.*; "
                     r"--memory-limit 1MB\): raise --memory-limit", result.output), result.output
    assert not (tmp_path / "tiny").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_engine_options_are_checked(tmp_path):
    imp, ev, schema_file = generated_logs(tmp_path, "csv")
    common = ["--impressions", str(imp), "--events", str(ev), "--schema", str(schema_file),
              "--out", str(tmp_path / "out")]
    result = run_import(*common, "--memory-limit", "2GB")
    assert result.exit_code == 1
    assert "Error: --memory-limit applies to --engine duckdb" in result.output
    result = run_import(*common, "--engine", "duckdb", "--memory-limit", "2 parsecs")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "Error: --memory-limit '2 parsecs' is not a size DuckDB reads" in result.output
    result = run_import(*common, "--engine", "spark")
    assert result.exit_code == 2 and "'spark' is not one of 'numpy', 'duckdb'" in result.output
    assert not (tmp_path / "out").exists()


def test_bench_import_runs_each_engine_in_a_process_of_its_own(tmp_path):
    from gem_data.bench_import import bench_import

    result = CliRunner().invoke(bench_import, ["--impressions", "400", "--events", "2000",
                                               "--dir", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    numpy_run, duckdb_run = report["results"]
    assert (numpy_run["engine"], duckdb_run["engine"]) == ("numpy", "duckdb")
    for run in (numpy_run, duckdb_run):
        assert "error" not in run, run
        assert run["rows_per_s"] > 0 and run["peak_rss_bytes"] > 10 * 2**20
    assert numpy_run["requests"] == duckdb_run["requests"] > 0
    assert numpy_run["history_events"] == duckdb_run["history_events"]
    assert duckdb_run["engine_info"]["memory_limit"] in ("1.8 GiB", "1.8GiB")
    assert list(tmp_path.iterdir()) == []
