"""Small raw logs for the tests of ``gem data import``'s engines, and the comparison those tests
make: each engine imports the same logs and must write what the numpy path writes, byte for
byte (:func:`compare_engines`), or stop with its error (:func:`engine_errors`). Shared by the
DuckDB and the Spark tests, so both are held to the same cases: 64-bit ids, multi-valued
features, empty and truncated histories, events at exactly the request time, a tie at the
cut, missing values, strings, vocabularies, side tables, bad logs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from gem_data.testing import hashed_log_schema

BIG = [2**64 - 1, 2**62 + 3, 2**53 + 1, 2**63]
"""Ids no float64 holds (and uint64 ones beyond int64)."""

SMALL_BLOCKS = {"block_rows": 5, "block_bytes": 160}
"""Blocks of a few rows (Parquet) or bytes (CSV): every block boundary is crossed."""

SCHEMA = hashed_log_schema(max_seq_len=4, eval_fraction=0.25)
"""The schema of :func:`generated_logs`."""

USERS = [2**64 - 1, 2**62 + 3, 5, 7, 2**63, 11, 13, 17]
"""The users of :func:`generated_logs`; the last two have no events."""


def signed(value: int) -> int:
    """A uint64 id as the int64 of its bits, as data sets hold it."""
    return value - (1 << 64) if value >= 1 << 63 else value


def compare_engines(tmp_path: Path, imp: Path, ev: Path, schema_file: Path, *,
                    engines: tuple[str, ...] = ("numpy", "duckdb"), blocks: dict | None = None,
                    engine_options: dict[str, dict[str, Any]] | None = None,
                    **options: Any) -> list[Any]:
    """Import with each engine into ``tmp_path / engine``; assert that every other engine's
    data files are the first's, byte for byte, and the reports agree; the manifests.
    ``blocks``: the block sizes of the engines other than numpy (default
    :data:`SMALL_BLOCKS`); ``engine_options``: more options per engine."""
    import pyarrow.parquet as pq

    from gem_data.importer import import_logs

    manifests = []
    for engine in engines:
        extra = {} if engine == "numpy" else dict(SMALL_BLOCKS if blocks is None else blocks)
        extra.update((engine_options or {}).get(engine, {}))
        manifests.append(import_logs(imp, ev, schema_file, tmp_path / engine, engine=engine,
                                     **extra, **options))
    a = manifests[0]
    for engine, b in zip(engines[1:], manifests[1:]):
        assert set(a.splits) == set(b.splits), engine
        for split in a.splits:
            (fa,), (fb,) = a.splits[split], b.splits[split]
            ta = pq.read_table(tmp_path / engines[0] / fa.path)
            tb = pq.read_table(tmp_path / engine / fb.path)
            for column in ta.column_names:
                assert ta.column(column).to_pylist() == tb.column(column).to_pylist(), \
                    (engine, split, column)
            assert (fa.rows, fa.row_groups, fa.tokens, fa.candidates) == \
                (fb.rows, fb.row_groups, fb.tokens, fb.candidates), (engine, split)
            assert fa.sha256 == fb.sha256, (engine, split)  # byte for byte
        for key in ("split", "requests", "features", "vocabularies"):
            assert a.info[key] == b.info[key], (engine, key)
        assert b.info["engine"]["name"] == engine
        assert sorted(p.name for p in (tmp_path / engine).iterdir()) == \
            sorted(p.name for p in (tmp_path / engines[0]).iterdir())  # no work files left
    assert a.info["engine"]["name"] == engines[0]
    return manifests


# -- generated logs: 64-bit ids, lists, ties, empty histories, events at the request time -----


def generated_logs(tmp_path: Path, kind: str, *, request_id: bool = True,
                   seed: int = 3) -> tuple[Path, Path, Path]:
    """An impression and an event log (``kind``: csv or parquet) and :data:`SCHEMA`'s file:
    ``(impressions, events, schema)``. Requests at four times (a tie at the cut), the
    impressions of a request not adjacent, an event at exactly most requests' time, uint64
    ids (:data:`BIG`), users without events."""
    import pyarrow as pa
    import pyarrow.parquet as pq

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
        def cell(v: Any) -> str:
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


# -- missing values, strings, vocabularies ------------------------------------------------------

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
"""A schema with every missing-value policy, a ``hash`` and a ``vocabulary`` string table."""


def missing_value_logs(tmp_path: Path) -> tuple[Path, Path, Path, Path]:
    """Logs of text users with missing values everywhere, strings (``café``), a uint64 id
    beyond int64, and a later event log with a value the vocabulary lacks: ``(impressions,
    events, schema, later events)``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

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
    pq.write_table(pa.table({"user_id": ["a"], "timestamp": [30], "ad": pa.array([1], pa.uint64()),
                             "topics": pa.array([[1]], pa.list_(pa.int64())),
                             "btag": ["share"]}), tmp_path / "ev2.parquet")
    (tmp_path / "s.toml").write_text(MISSING)
    return (tmp_path / "imp.parquet", tmp_path / "ev.parquet", tmp_path / "s.toml",
            tmp_path / "ev2.parquet")


# -- side tables --------------------------------------------------------------------------------

SIDE_TABLES = (
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
"""A schema joining an ad table (keys of 64 bits) to both logs and a user table (a missing
row) to the impressions."""


def side_table_logs(tmp_path: Path) -> tuple[Path, Path, Path]:
    """CSV logs, an ad table (Parquet, uint64 keys) and a user table (CSV, a row of empty
    cells) for :data:`SIDE_TABLES`: ``(impressions, events, schema)``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    a, b = 2**63 + 1, 2**64 - 2
    pq.write_table(pa.table({"ad_id": pa.array([a, b, 3], pa.uint64()),
                             "category": [3, 4, 5]}), tmp_path / "ads.parquet")
    (tmp_path / "users.csv").write_text("uid,age,income\n1,5,1.5\n2,,\n")
    (tmp_path / "imp.csv").write_text("user_id,timestamp,ad,click\n" + "".join(
        f"{u},{t},{ad},{i % 2}\n" for i, (u, t, ad) in enumerate(
            [(1, 100, a), (1, 100, b), (2, 200, b), (3, 300, 7), (2, 300, 3), (1, 400, a)])))
    (tmp_path / "ev.csv").write_text(f"user_id,timestamp,ad\n1,50,{b}\n2,60,7\n1,100,{a}\n"
                                     f"2,250,3\n")
    (tmp_path / "s.toml").write_text(SIDE_TABLES)
    return tmp_path / "imp.csv", tmp_path / "ev.csv", tmp_path / "s.toml"


# -- bad logs: every engine stops with the numpy path's error -----------------------------------

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
"""Impression logs (CSV, under :data:`HEADER`, for :data:`RULES`) that break one rule each."""


def engine_errors(tmp_path: Path, impressions: str, *, schema: str = RULES,
                  engines: tuple[str, ...] = ("numpy", "duckdb"),
                  engine_options: dict[str, dict[str, Any]] | None = None) -> dict[str, str]:
    """Import the CSV ``impressions`` (under :data:`HEADER`) with each engine, each of which
    must stop with a GemDataError and write nothing; the messages by engine."""
    from gem_core.errors import GemDataError
    from gem_data.importer import import_logs

    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "s.toml").write_text(schema)
    (tmp_path / "imp.csv").write_text(HEADER + impressions)
    (tmp_path / "ev.csv").write_text("user_id,timestamp,ad\nu1,5,1\nu2,6,2\n")
    messages = {}
    for engine in engines:
        try:
            import_logs(tmp_path / "imp.csv", tmp_path / "ev.csv", tmp_path / "s.toml",
                        tmp_path / engine, engine=engine,
                        **(engine_options or {}).get(engine, {}))
        except GemDataError as error:
            messages[engine] = str(error)
        else:
            raise AssertionError(f"{engine} imported the bad log")
        assert not (tmp_path / engine).exists(), engine
    return messages
