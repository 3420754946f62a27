"""``gem data import --engine duckdb`` beyond memory (issue #28): DuckDB spills what does not fit
under ``--memory-limit`` into ``--temp-dir`` and still writes the numpy engine's bytes; a hash
collision of two strings is found however far apart the logs' blocks put them; side tables
(``[[import.join]]``) are looked up block by block, not held in memory, with the numpy path's
rules and counts."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from gem_core.errors import GemDataError
from gem_data.importer import import_command, import_logs

pytest.importorskip("duckdb")


def same_files(a, b) -> None:
    """Both data sets hold byte-identical data files."""
    assert {s: [f.sha256 for f in files] for s, files in a.splits.items()} == \
        {s: [f.sha256 for f in files] for s, files in b.splits.items()}


# -- 1. DuckDB spills ---------------------------------------------------------------------------


def test_duckdb_spills_to_the_temp_dir_under_a_small_memory_limit(tmp_path, monkeypatch):
    """100 users with 3,000 events each and requests spread over their time: 1.8M history
    events to join and sort (over 100 MB in DuckDB), under an 80 MB limit on two threads. Mid-
    import, with DuckDB's sorted streams open, its temporary files are in --temp-dir and hold
    tens of MB; the data set is the numpy engine's, byte for byte; --temp-dir is left empty.
    (Before the histories were joined apart from their sort, this import ran out of memory.)"""
    from gem_data import import_duckdb
    from gem_data.bench_import import write_logs

    imp, ev, schema_file = write_logs(tmp_path / "logs", 20_000, 300_000, users=100)
    spill = tmp_path / "spill"
    seen: list[list[tuple[str, int]]] = []
    monkeypatch.setattr(import_duckdb, "on_block", lambda run: seen.append(run.temporary_files()))
    result = CliRunner().invoke(import_command, [
        "--impressions", str(imp), "--events", str(ev), "--schema", str(schema_file),
        "--out", str(tmp_path / "duckdb"), "--engine", "duckdb", "--memory-limit", "80MB",
        "--threads", "2", "--temp-dir", str(spill), "--row-group-rows", "1024"])
    assert result.exit_code == 0, result.output
    assert len(seen) > 4  # blocks of 1024 requests: the streams were read a part at a time
    spilled = [sum(size for _, size in files) for files in seen]
    assert max(spilled) > 16 * 2**20, spilled  # not bookkeeping: the sorted histories spilled
    for files in seen:
        for path, _ in files:
            assert Path(path).is_relative_to(spill), path
    assert list(spill.iterdir()) == []  # the work directory, spill files and all, is gone
    info = json.loads((tmp_path / "duckdb" / "manifest.json").read_text())["info"]
    assert info["engine"]["memory_limit"] in ("76.2 MiB", "76.2MiB")
    assert info["engine"]["threads"] == 2
    reference = import_logs(imp, ev, schema_file, tmp_path / "numpy", row_group_rows=1024)
    splits = json.loads((tmp_path / "duckdb" / "manifest.json").read_text())["splits"]
    assert {s: [f["sha256"] for f in e["files"]] for s, e in splits.items()} == \
        {s: [f.sha256 for f in files] for s, files in reference.splits.items()}
    assert reference.tokens("train") + reference.tokens("eval") > 1_500_000


# -- both engines on the same logs ---------------------------------------------------------------


def write(directory: Path, schema_text: str, **logs) -> tuple[Path, Path, Path]:
    """Write ``logs`` (``name_suffix``: an arrow table, or the text of a CSV) and the schema
    into ``directory``: the impression log, the event log and the schema file."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in logs.items():
        path = directory / name.replace("_", ".")
        if isinstance(content, str):
            path.write_text(content)
        else:
            pq.write_table(content, path)
    (directory / "s.toml").write_text(schema_text)
    return next(directory.glob("imp.*")), next(directory.glob("ev.*")), directory / "s.toml"


def both(directory: Path, schema_text: str, blocks: dict, **logs) -> tuple:
    """Import ``logs`` with each engine (DuckDB reading in ``blocks``): the two manifests,
    whose data files are byte-identical and reports equal."""
    imp, ev, schema_file = write(directory, schema_text, **logs)
    a = import_logs(imp, ev, schema_file, directory / "numpy")
    b = import_logs(imp, ev, schema_file, directory / "duckdb", engine="duckdb", **blocks)
    same_files(a, b)
    for key in ("split", "requests", "features", "vocabularies"):
        assert a.info[key] == b.info[key], key
    return a, b


def refused(directory: Path, schema_text: str, blocks: dict, **logs) -> str:
    """The message with which both engines refuse ``logs`` (the same)."""
    imp, ev, schema_file = write(directory, schema_text, **logs)
    messages = []
    for engine, options in (("numpy", {}), ("duckdb", blocks)):
        with pytest.raises(GemDataError) as error:
            import_logs(imp, ev, schema_file, directory / engine, engine=engine, **options)
        messages.append(str(error.value))
        assert not (directory / engine).exists()
    assert messages[0] == messages[1]
    return messages[0]


# -- 2. two strings with one hash id, in different blocks ---------------------------------------

HASHED = ('tasks = ["click"]\n'
          '[[tables]]\nname = "ad"\nnum_embeddings = 100\n'
          '[[tables]]\nname = "tag"\nnum_embeddings = 1000\nid_policy = "hash"\n'
          '[[event_features]]\nname = "ad"\ntable = "ad"\n'
          '[[event_features]]\nname = "tag"\ntable = "tag"\n'
          '[[candidate_features]]\nname = "ad"\ntable = "ad"\n'
          '[[candidate_features]]\nname = "tags"\ntable = "tag"\nmulti_valued = true\n'
          '[import]\neval_fraction = 0\n[import.strings]\ntag = "hash"\n')
SIDE_TAGS = ('[[import.join]]\nfile = "tags.parquet"\nkey = "ad"\nlog = "events"\n'
             'features = { "event.tag" = "tag" }\n')
WORDS = ["w%d" % i for i in range(20)]


def hashed_logs(where: str) -> dict:
    """Logs whose hashed texts hold 'alpha' early, 'omega' and 'zeta' blocks later (in the
    impressions' tags, the events' tag, or a side table's tag column), among other words."""
    tags = [[WORDS[i], WORDS[(i + 3) % 20]] for i in range(12)]
    ev_tags = [WORDS[i] for i in range(12)]
    if where == "impressions":
        tags[0][1], tags[7][0], tags[10][1] = "alpha", "omega", "zeta"
    else:
        ev_tags[1], ev_tags[8], ev_tags[11] = "alpha", "omega", "zeta"
    logs = {"imp_parquet": pa.table({"user_id": [i % 3 for i in range(12)],
                                     "timestamp": [100 + i for i in range(12)],
                                     "ad": [i % 7 for i in range(12)], "tags": tags,
                                     "click": [i % 2 for i in range(12)]}),
            "ev_parquet": pa.table({"user_id": [i % 3 for i in range(12)],
                                    "timestamp": [10 + i for i in range(12)],
                                    "ad": list(range(12)), "tag": ev_tags})}
    if where == "side table":
        logs["tags_parquet"] = pa.table({"ad": list(range(12)), "tag": ev_tags})
        logs["ev_parquet"] = logs["ev_parquet"].drop_columns(["tag"])
    return logs


@pytest.mark.parametrize("where", ["impressions", "events", "side table"])
def test_two_texts_with_one_hash_id_in_different_blocks_are_refused(tmp_path, monkeypatch,
                                                                     where):
    """'alpha', 'omega' and 'zeta' made to share the hash id 42, each in a block of its own
    (two rows a block): both engines refuse the logs naming the file, the column and the first
    two texts met ('alpha', 'omega'). Before, the DuckDB engine, which checked each block
    apart, imported them with three categories merged."""
    from gem_data import import_strings

    real = import_strings.string_id
    monkeypatch.setattr(import_strings, "string_id",
                        lambda text: 42 if text in ("alpha", "omega", "zeta") else real(text))
    schema = HASHED + (SIDE_TAGS if where == "side table" else "")
    message = refused(tmp_path, schema, {"block_rows": 2}, **hashed_logs(where))
    file, column = {"impressions": ("imp.parquet", "tags"), "events": ("ev.parquet", "tag"),
                    "side table": ("tags.parquet", "tag")}[where]
    assert message == (f"{tmp_path / file}, column {column!r}: texts 'alpha' and 'omega' have "
                       "the same 64-bit hash id 42; use import.strings = \"vocabulary\" for "
                       "this table")
    # Without the collision, both engines import the same logs alike.
    monkeypatch.setattr(import_strings, "string_id", real)
    both(tmp_path / "fine", schema, {"block_rows": 2}, **hashed_logs(where))


# -- 3. side tables, looked up block by block -----------------------------------------------------

A, B = 2**63 + 1, 2**64 - 2
SIDE = ('tasks = ["click"]\nnum_dense = 1\n'
        '[[tables]]\nname = "ad"\nnum_embeddings = 1000\nid_policy = "hash"\n'
        '[[tables]]\nname = "cate"\nnum_embeddings = 10\n'
        '[[tables]]\nname = "tag"\nnum_embeddings = 50\n'
        '[[tables]]\nname = "brand"\nnum_embeddings = 1000\nid_policy = "hash"\n'
        '[[tables]]\nname = "age"\nnum_embeddings = 8\n'
        '[[event_features]]\nname = "ad"\ntable = "ad"\n'
        '[[event_features]]\nname = "cate"\ntable = "cate"\n'
        '[[candidate_features]]\nname = "ad"\ntable = "ad"\n'
        '[[candidate_features]]\nname = "cate"\ntable = "cate"\n'
        '[[candidate_features]]\nname = "tags"\ntable = "tag"\nmulti_valued = true\n'
        '[[candidate_features]]\nname = "brand"\ntable = "brand"\n'
        '[[sparse_features]]\nname = "age"\ntable = "age"\n'
        '[import]\neval_fraction = 0.25\ndense_columns = ["income"]\n'
        '[import.strings]\nbrand = "hash"\n'
        '[[import.join]]\nfile = "ads.parquet"\nkey = "ad_id"\nlog = "impressions"\n'
        'log_key = "ad"\nfeatures = { "candidate.cate" = "category", "candidate.tags" = "tags", '
        '"candidate.brand" = "brand" }\n'
        '[[import.join]]\nfile = "ads.parquet"\nkey = "ad_id"\nlog = "events"\n'
        'log_key = "ad"\nfeatures = { "event.cate" = "category" }\n'
        '[[import.join]]\nfile = "users.csv"\nkey = "uid"\nlog = "impressions"\n'
        'log_key = "user_id"\nfeatures = { "sparse.age" = "age", "dense.income" = "income" }\n'
        '[import.features]\n"candidate.cate" = { missing = "default", default = 0 }\n'
        '"candidate.tags" = { missing = "default", default = 0 }\n'
        '"candidate.brand" = { missing = "default", default = 1 }\n'
        '"event.cate" = { missing = "drop" }\n"sparse.age" = { missing = "default", default = 7 }\n'
        '"dense.income" = { missing = "default", default = -1.0 }\n')
ADS = [A, B] + list(range(100, 138))  # 40 ads; the logs also show ads 7 and 8, not among them


def side_logs(ads: list[int] = ADS, users: str | None = None, categories: bool = False) -> dict:
    """An ad table (40 rows: 64-bit keys, null categories, null ids inside tag lists, brands
    as text), a user table of text keys (CSV; u3's age and income missing, u7 and u8 not
    there), and logs of 60 impressions and 80 events showing 2 to 4 ads a block.
    ``categories``: no category is null."""
    n = len(ads)
    tags = [[i % 50, None, (i * 7) % 50] if i % 5 == 0 else [i % 50] for i in range(n)]
    table = pa.table({"ad_id": pa.array(ads, pa.uint64()),
                      "category": pa.array([None if i % 9 == 4 and not categories else i % 10
                                            for i in range(n)],
                                           pa.int64()),
                      "tags": pa.array(tags, pa.list_(pa.int64())),
                      "brand": [None if i % 11 == 3 else f"brand-{i % 13}" for i in range(n)]})
    shown = ADS[:12] + [7, 8]
    imp = pa.table({"user_id": [f"u{1 + (i // 4) % 8}" for i in range(60)],
                    "timestamp": [1000 + 10 * (i // 4) for i in range(60)],
                    "ad": pa.array([shown[(i * 5) % len(shown)] for i in range(60)], pa.uint64()),
                    "click": [i % 2 for i in range(60)]})
    ev = pa.table({"user_id": [f"u{1 + i % 8}" for i in range(80)],
                   "timestamp": [900 + 3 * i for i in range(80)],
                   "ad": pa.array([shown[(i * 3) % len(shown)] for i in range(80)], pa.uint64())})
    users = users or "uid,age,income\n" + "".join(
        f"u{u},{'' if u == 3 else u % 8},{'' if u == 3 else u * 1.5}\n" for u in range(1, 7))
    return {"imp_parquet": imp, "ev_parquet": ev, "ads_parquet": table, "users_csv": users}


def test_side_tables_are_looked_up_block_by_block_with_the_numpy_paths_results(tmp_path,
                                                                              monkeypatch):
    """The DuckDB engine never reads a side table whole: each block of 4 rows is given the
    side-table rows of its own keys (at most 4 of the 40 ads), and the data set is the numpy
    engine's byte for byte, with the same counts (a key not in a side table counted under its
    feature's policy; null ids inside the side table's lists counted once, not once per
    block, as they were before)."""
    from gem_data import import_duckdb_side, import_features

    looked_up: list[int] = []
    rows = import_duckdb_side.SideStore._rows

    def counted(self, *args):
        side = rows(self, *args)
        looked_up.append(side.log.table.num_rows)
        return side

    whole = import_features.SideTable.__init__
    read_whole: list[str] = []

    def reading(self, join, *args):
        read_whole.append(join.file)
        whole(self, join, *args)

    monkeypatch.setattr(import_duckdb_side.SideStore, "_rows", counted)
    monkeypatch.setattr(import_features.SideTable, "__init__", reading)
    a, _ = both(tmp_path, SIDE, {"block_rows": 4, "block_bytes": 40}, **side_logs())
    assert len(read_whole) == 3  # the numpy engine's three joins, read whole; DuckDB's none
    assert looked_up and max(looked_up) <= 4 and len(ADS) == 40
    counts = a.info["features"]
    assert counts["candidate.tags"]["null_ids_removed"] == 8  # 8 ads have a null tag id
    assert counts["candidate.cate"]["not_in_side_table"] > 0
    assert counts["sparse.age"]["not_in_side_table"] > 0
    assert counts["dense.income"]["missing"] > counts["dense.income"]["not_in_side_table"]
    assert a.info["requests"]["dropped_events"] > 0  # event.cate: missing = "drop"


def test_side_table_errors_are_the_numpy_paths(tmp_path):
    """A key twice (both in blocks apart from their first), a key not in the side table under
    missing = "error", keys of another type than the log's: each refused by both engines with
    the numpy engine's message."""
    blocks = {"block_rows": 4, "block_bytes": 40}
    twice = ADS[:30] + [ADS[20], 105, ADS[3]] + ADS[30:]
    message = refused(tmp_path / "twice", SIDE, blocks, **side_logs(ads=twice))
    # Ads 118, 105 and 101 again on rows 30-32: the first in key order is named.
    assert message == (f"{tmp_path / 'twice' / 'ads.parquet'}, row 32, column 'ad_id': key 101 "
                       "appears again (first on row 3; 3 repeated keys); a side table has one "
                       "row per key")
    # Every category there, every ad in the table but row 13's: that row is named.
    strict = SIDE.replace('"candidate.cate" = { missing = "default", default = 0 }',
                          '"candidate.cate" = { missing = "error" }')
    logs = side_logs(categories=True)
    ads = [7 if i == 13 else ADS[0] if a in (7, 8) else a
           for i, a in enumerate(logs["imp_parquet"].column("ad").to_pylist())]
    logs["imp_parquet"] = logs["imp_parquet"].set_column(2, "ad", pa.array(ads, pa.uint64()))
    message = refused(tmp_path / "missing", strict, blocks, **logs)
    assert message == (f"{tmp_path / 'missing' / 'imp.parquet'}, row 13, column 'ad': key 7 is "
                       f"not in side table {tmp_path / 'missing' / 'ads.parquet'} (column "
                       "'ad_id'), which gives feature candidate.cate (1 such rows); to allow it "
                       'set [import.features."candidate.cate"] missing = "default" or "drop"')
    numbers = "uid,age,income\n" + "".join(f"{u},{u % 8},{u * 1.5}\n" for u in range(1, 7))
    message = refused(tmp_path / "types", SIDE, blocks, **side_logs(users=numbers))
    assert "have different types (one integers, one text)" in message
