"""``gem data import --engine numpy|duckdb`` (issue #28, item 1): DuckDB writes the requests the
numpy path writes (row for row, every column, the same split: byte-identical files) on the same
logs, read in blocks of a few rows so that every rule meets block boundaries; its errors are the
numpy path's; ``--memory-limit`` reaches DuckDB; ``gem bench import`` runs the engines. The logs
and the comparison are :mod:`gem_data.testing_logs`' (test_import_spark.py holds Spark to the
same cases)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from gem_data.importer import import_command, import_logs
from gem_data.testing_logs import (
    BAD_CASES,
    GOOD,
    RULES,
    compare_engines,
    engine_errors,
    generated_logs,
    missing_value_logs,
    side_table_logs,
    signed,
)

pytest.importorskip("duckdb")

DOC = Path(__file__).resolve().parents[3] / "docs" / "byod.md"


def both(tmp_path: Path, imp: Path, ev: Path, schema_file: Path, **options):
    """Import with numpy and DuckDB: identical data files, agreeing reports
    (:func:`~gem_data.testing_logs.compare_engines`)."""
    return compare_engines(tmp_path, imp, ev, schema_file, engines=("numpy", "duckdb"), **options)


# -- generated logs: 64-bit ids, lists, ties, empty histories, events at the request time -----


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


def test_engines_agree_on_missing_policies_strings_and_reused_vocabularies(tmp_path):
    imp, ev, schema_file, later_events = missing_value_logs(tmp_path)
    a, _ = both(tmp_path, imp, ev, schema_file, blocks={"block_rows": 2})
    assert a.info["requests"]["dropped_impressions"] == 2
    assert a.info["features"]["event.topics"]["null_ids_removed"] == 2
    assert a.info["vocabularies"]["btag"]["values"] == 4
    # A later import reusing the vocabularies: unknown values counted the same.
    later = tmp_path / "later"
    later.mkdir()
    a, _ = both(later, imp, later_events, schema_file, vocabulary_from=tmp_path / "numpy")
    assert a.info["features"]["event.btag"]["out_of_vocabulary"] == 1


def test_engines_agree_on_side_tables_with_64_bit_keys(tmp_path):
    imp, ev, schema_file = side_table_logs(tmp_path)
    a, _ = both(tmp_path, imp, ev, schema_file, blocks={"block_bytes": 40})
    assert a.info["features"]["candidate.cate"]["not_in_side_table"] == 1
    # A dense feature from a side table: the user's value, or the default (null, no row).
    # (Before, the numpy path gathered the side table's rows twice: user 2 got user 1's 1.5.)
    dense = [v for split in ("train", "eval") for v in pq.read_table(
        tmp_path / "numpy" / f"{split}-00000.parquet").column("dense").to_pylist()]
    assert dense == [[1.5], [-1.0], [-1.0], [-1.0], [1.5]]


# -- errors: the numpy path's, from DuckDB too ---------------------------------------------------

@pytest.mark.parametrize("case", list(BAD_CASES))
def test_errors_are_the_numpy_paths(tmp_path, case):
    messages = engine_errors(tmp_path, BAD_CASES[case])
    assert messages["duckdb"] == messages["numpy"]
    assert str(tmp_path / "imp.csv") in messages["numpy"] and "line" in messages["numpy"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_two_keys_with_one_request_id_are_refused_by_both_engines(tmp_path, monkeypatch):
    from gem_data import import_requests

    monkeypatch.setattr(import_requests, "_splitmix", lambda v: v * 0)
    messages = engine_errors(tmp_path, GOOD, schema=RULES.replace(
        "[import]\n", '[import]\nrequest_columns = ["user_id", "timestamp"]\n'))
    assert "have the same 64-bit request id 0" in messages["numpy"]
    assert messages["duckdb"] == messages["numpy"]


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
    result = run_import(*common, "--engine", "flink")
    assert result.exit_code == 2
    assert "'flink' is not one of 'numpy', 'duckdb', 'spark'" in result.output
    assert not (tmp_path / "out").exists()


def test_bench_import_runs_each_engine_in_a_process_of_its_own(tmp_path):
    from gem_data.bench_import import bench_import

    result = CliRunner().invoke(bench_import, ["--impressions", "400", "--events", "2000",
                                               "--engines", "numpy,duckdb",
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
