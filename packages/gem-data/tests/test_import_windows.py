"""``gem data import --window NAME`` and ``--append`` (issue #27): a data set of time windows
built one window of logs at a time is, request for request, the data set one import of all the
logs writes (histories continued through each window's history tail, users and request keys
numbered the same), with either engine; appending refuses what would break that (earlier logs,
another schema or options, a name taken) naming what is wrong, and a failed append leaves the
data set as it was; ``gem data inspect`` lists the windows, ``gem data validate`` checks the
state files."""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from gem_core.errors import GemDataError
from gem_data.cli import data_group
from gem_data.dataset import DatasetReader
from gem_data.importer import import_command, import_logs
from gem_data.manifest import MANIFEST_NAME, read_manifest
from gem_data.testing import hashed_log_schema

SCHEMA = hashed_log_schema(max_seq_len=3, eval_fraction=0)

WINDOWS = {"A": (1000, 1999), "B": (2000, 2999), "C": (3000, 3999)}
"""Each window's time range (seconds): the logs are cut by these."""

ID = 2**62  # ids near 2^62, beyond what float64 holds exactly
# Users: LONG's events span all three windows, more than max_seq_len in each; NONE has no
# event at all; GONE has events only in window A and a request in C (its history comes
# through B's tail); TIED has an event at exactly a request's time (left out) and two events
# at one time (kept in log order).
LONG, NONE, GONE, TIED = 2**62 + 1, 2**62 + 7, 2**64 - 5, 5
TEXT_USERS = {LONG: "alice", NONE: "bob", GONE: "carol", TIED: "7"}


def signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def blake_id(text: str) -> int:
    """The documented ``hash`` string id: BLAKE2b-64 of the UTF-8 bytes, little-endian."""
    return signed(int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(),
                                 "little"))


def log_rows() -> tuple[list[tuple], list[tuple]]:
    """``(impressions, events)``: impressions (user, time, ad, topics, seg, score, click),
    events (user, time, ad, topics), in no particular time order."""
    events = [(LONG, t, ID + t, [ID + t % 7, ID + 1]) for t in range(1000, 4000, 50)]
    events += [(GONE, t, ID + 2 * t, [ID + 3]) for t in (1100, 1300, 1400, 1600, 1700)]
    events += [(TIED, 2200, ID + 22, [ID + 4]), (TIED, 2400, ID + 24, [ID + 5]),
               (TIED, 2400, ID + 25, [ID + 6, ID + 7]), (TIED, 2600, ID + 26, [ID + 8])]
    requests = [(LONG, 1500), (LONG, 2100), (LONG, 3000), (LONG, 3999), (NONE, 1200),
                (NONE, 2500), (NONE, 3500), (GONE, 1800), (GONE, 3200), (TIED, 2400),
                (TIED, 3100)]
    impressions = []
    for r, (user, time) in enumerate(requests):
        for k in range(1 + r % 2):  # one or two candidates
            impressions.append((user, time, ID + 100 * r + k, [ID + k, ID + r][: 1 + k],
                                [ID + r % 3], float(r % 4) / 2, (r + k) % 2))
    # Not in time order: a window's rows are the full log's rows of its time range.
    return impressions[::-1], events[1::2] + events[::2]


def write_logs(directory: Path, impressions: list[tuple], events: list[tuple], *,
               text_users: bool = False) -> tuple[Path, Path]:
    """The logs as Parquet files in ``directory`` (ids as uint64; users as text when
    ``text_users``, with a request id column then)."""
    directory.mkdir(parents=True, exist_ok=True)
    user_type = pa.string() if text_users else pa.uint64()

    def users(rows: list[tuple]) -> pa.Array:
        return pa.array([TEXT_USERS[r[0]] if text_users else r[0] for r in rows], user_type)

    imp = {"user_id": users(impressions), "timestamp": [r[1] for r in impressions],
           "ad": pa.array([r[2] for r in impressions], pa.uint64()),
           "topics": pa.array([r[3] for r in impressions], pa.list_(pa.uint64())),
           "seg": pa.array([r[4] for r in impressions], pa.list_(pa.uint64())),
           "score": [r[5] for r in impressions], "click": [r[6] for r in impressions]}
    if text_users:
        imp["request_id"] = [f"{TEXT_USERS[r[0]]}@{r[1]}" for r in impressions]
    pq.write_table(pa.table(imp), directory / "imp.parquet")
    pq.write_table(pa.table({"user_id": users(events), "timestamp": [r[1] for r in events],
                             "ad": pa.array([r[2] for r in events], pa.uint64()),
                             "topics": pa.array([r[3] for r in events],
                                                pa.list_(pa.uint64()))}),
                   directory / "ev.parquet")
    return directory / "imp.parquet", directory / "ev.parquet"


def window_logs(tmp_path: Path, *, text_users: bool = False) -> dict[str, tuple[Path, Path]]:
    """The logs of all windows together (``all``) and of each window."""
    impressions, events = log_rows()
    logs = {"all": write_logs(tmp_path / "all", impressions, events, text_users=text_users)}
    for name, (low, high) in WINDOWS.items():
        logs[name] = write_logs(tmp_path / name, [r for r in impressions if low <= r[1] <= high],
                                [r for r in events if low <= r[1] <= high], text_users=text_users)
    return logs


def schema_file(tmp_path: Path, text: str = SCHEMA, name: str = "s.toml") -> Path:
    (tmp_path / name).write_text(text)
    return tmp_path / name


def build_windows(tmp_path: Path, logs: dict, schema: Path, out: Path, engine: str = "numpy",
                  names: tuple[str, ...] = ("A", "B", "C")) -> object:
    manifest = None
    for i, name in enumerate(names):
        manifest = import_logs(*logs[name], schema, out, engine=engine, window=name,
                               append=i > 0, block_rows=4)
    return manifest


def requests(directory: Path) -> list[dict]:
    """Every request of the data set (all splits), sorted by user and request time."""
    manifest = read_manifest(directory)
    rows = [row for files in manifest.splits.values() for entry in files
            for row in pq.read_table(directory / entry.path).to_pylist()]
    return sorted(rows, key=lambda r: (r["user_id"], r["request_timestamp"]))


def history_times(rows: list[dict], user: int, time: int) -> list[int]:
    (row,) = [r for r in rows if r["user_id"] == user and r["request_timestamp"] == time]
    return row["history_timestamp"]


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` with its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file()}


# -- THE acceptance test ------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["numpy", "duckdb"])
@pytest.mark.parametrize("users", ["integers", "text"])
def test_three_appended_windows_equal_one_import_of_all_the_logs(tmp_path, engine, users):
    if engine == "duckdb":
        pytest.importorskip("duckdb")
    text = users == "text"
    logs = window_logs(tmp_path, text_users=text)
    schema = schema_file(tmp_path)
    one = import_logs(*logs["all"], schema, tmp_path / "one")
    manifest = build_windows(tmp_path, logs, schema, tmp_path / "windows", engine)

    expected, got = requests(tmp_path / "one"), requests(tmp_path / "windows")
    assert len(got) == len(expected) == 11
    for a, b in zip(expected, got):
        assert a == b  # every column, request for request
    assert [w.name for w in manifest.windows] == ["A", "B", "C"]
    assert manifest.rows("train") == one.rows("train") and "eval" not in manifest.splits
    assert [(w.first_time, w.last_time) for w in manifest.windows] == \
        [(1200, 1950), (2100, 2950), (3000, 3999)]

    number = {u: blake_id(TEXT_USERS[u]) if text else signed(u) for u in TEXT_USERS}
    assert {r["user_id"] for r in got} == set(number.values())  # GAUC's groups, stable
    # GONE's request in C has its last three events of A, carried through B's tail; the
    # event at exactly TIED's request time is left out; LONG's is cut at max_seq_len.
    assert history_times(got, number[GONE], 3200) == [1400, 1600, 1700]
    assert history_times(got, number[TIED], 2400) == [2200]
    assert history_times(got, number[TIED], 3100) == [2400, 2400, 2600]
    (tied,) = [r for r in got if r["user_id"] == number[TIED] and r["request_timestamp"] == 3100]
    _, events = log_rows()
    at_2400 = [(e[2], e[3]) for e in events if e[0] == TIED and e[1] == 2400]  # log order
    assert tied["event.ad"] == [ad for ad, _ in at_2400] + [ID + 26]
    assert tied["event.topics"] == [topics for _, topics in at_2400] + [[ID + 8]]
    assert at_2400[0][0] == ID + 25  # not the order of the list the log was written from
    assert history_times(got, number[LONG], 3000) == [2850, 2900, 2950]
    assert history_times(got, number[NONE], 3500) == []

    # The last window's tail: per user, the last max_seq_len events of all the logs.
    (tail,) = manifest.windows[-1].state
    assert tail.path == "windows/C/history_tail.parquet"
    wanted = []
    for user in sorted(number, key=lambda u: number[u]):
        mine = sorted((e for e in events if e[0] == user), key=lambda e: e[1])
        wanted += [{"user_id": number[user], "time": e[1], "event.ad": signed(e[2]),
                    "event.topics": e[3]} for e in mine[-3:]]
    assert pq.read_table(tmp_path / "windows" / tail.path).to_pylist() == wanted


def test_the_engines_write_the_same_windows(tmp_path):
    pytest.importorskip("duckdb")
    logs = window_logs(tmp_path)
    schema = schema_file(tmp_path)
    a = build_windows(tmp_path, logs, schema, tmp_path / "numpy", "numpy")
    b = build_windows(tmp_path, logs, schema, tmp_path / "duckdb", "duckdb")
    for wa, wb in zip(a.windows, b.windows):
        assert (wa.name, wa.files, wa.first_time, wa.last_time) == \
            (wb.name, wb.files, wb.first_time, wb.last_time)
        for path in wa.files:  # byte for byte
            assert (tmp_path / "numpy" / path).read_bytes() == \
                (tmp_path / "duckdb" / path).read_bytes(), path
        for sa, sb in zip(wa.state, wb.state):
            assert pq.read_table(tmp_path / "numpy" / sa.path).equals(
                pq.read_table(tmp_path / "duckdb" / sb.path))
        assert wa.info["requests"] == wb.info["requests"]


# -- the command, eval_fraction, vocabularies ------------------------------------------------


def test_the_command_appends_and_says_eval_fraction_is_not_used(tmp_path):
    logs = window_logs(tmp_path)
    schema = schema_file(tmp_path, SCHEMA.replace("eval_fraction = 0", "eval_fraction = 0.25"))
    out = tmp_path / "data"
    for i, name in enumerate(("A", "B")):
        imp, ev = logs[name]
        result = CliRunner().invoke(data_group, [
            "import", "--impressions", str(imp), "--events", str(ev), "--schema", str(schema),
            "--out", str(out), "--window", name, *(["--append"] if i else [])])
        assert result.exit_code == 0, result.output
        assert f"wrote window {name!r} to {out}" in result.output
        assert "import.eval_fraction = 0.25 is not used for windows: every request is in " \
               "train" in result.output
    assert "the data set has 2 windows, 6 requests" in result.output
    manifest = read_manifest(out)
    assert set(manifest.splits) == {"train"} and manifest.info["import"]["eval_fraction"] == 0.25


def test_the_commands_of_docs_byod_run_as_written(tmp_path, monkeypatch):
    doc = (Path(__file__).resolve().parents[3] / "docs" / "byod.md").read_text()
    (block,) = re.findall(r"<!-- byod-windows:command -->\n```sh\n(.*?)```", doc, flags=re.S)
    commands = [shlex.split(line) for line in block.splitlines() if line.strip()]
    logs = window_logs(tmp_path)
    for day, window in (("day1", "A"), ("day2", "B")):
        (tmp_path / day).mkdir()
        for log, path in zip(("impressions", "events"), logs[window]):
            path.rename(tmp_path / day / f"{log}.parquet")
    schema_file(tmp_path, name="schema.toml")
    monkeypatch.chdir(tmp_path)
    for command in commands:
        assert command[:3] == ["gem", "data", "import"]
        result = CliRunner().invoke(import_command, command[3:])
        assert result.exit_code == 0, result.output
    manifest = read_manifest(tmp_path / "my_days")
    assert [w.name for w in manifest.windows] == ["2026-11-30", "2026-12-01"]
    assert manifest.rows("train") == 6


VOCABULARY = SCHEMA.replace('[import]\n', '[import]\nstrings = { kind = "vocabulary" }\n').replace(
    '[[event_features]]\nname = "ad"', '[[tables]]\nname = "kind"\nnum_embeddings = 10\n'
    '[[event_features]]\nname = "kind"\ntable = "kind"\n[[event_features]]\nname = "ad"')


def test_an_appended_window_uses_the_data_sets_vocabularies(tmp_path):
    schema = schema_file(tmp_path, VOCABULARY)
    impressions, events = log_rows()
    logs = {}
    for name, kinds in (("A", "view"), ("B", "buy")):  # "buy" is not in A's vocabulary
        low, high = WINDOWS[name]
        imp, ev = write_logs(tmp_path / name, [r for r in impressions if low <= r[1] <= high],
                             [r for r in events if low <= r[1] <= high])
        table = pq.read_table(ev)
        pq.write_table(table.append_column("kind", pa.array(
            ["view" if i % 2 else kinds for i in range(table.num_rows)])), ev)
        logs[name] = (imp, ev)
    out = tmp_path / "data"
    first = import_logs(*logs["A"], schema, out, window="A")
    vocabulary = (out / "vocabulary.kind.json").read_bytes()
    assert json.loads(vocabulary)["values"] == ["view"]
    manifest = import_logs(*logs["B"], schema, out, window="B", append=True)
    assert (out / "vocabulary.kind.json").read_bytes() == vocabulary  # not rebuilt
    assert manifest.info["vocabularies"] == first.info["vocabularies"]
    b = manifest.windows[1]
    buys = pq.read_table(logs["B"][1]).column("kind").to_pylist().count("buy")
    assert b.info["features"]["event.kind"]["out_of_vocabulary"] == buys > 0
    assert b.info["vocabularies"]["kind"]["from"] == str(out)
    tail = pq.read_table(out / b.state[0].path).column("event.kind").to_pylist()
    assert set(tail) <= {1, 2} and 1 in tail  # "view" is id 2, "buy" out of vocabulary (1)
    with pytest.raises(GemDataError, match="--vocabulary-from does not apply to --append"):
        import_logs(*logs["B"], schema, out, window="C", append=True, vocabulary_from=out)


# -- refusals -----------------------------------------------------------------------------------


@pytest.fixture
def windowed(tmp_path):
    """A data set of windows A and B, with the logs of every window."""
    logs = window_logs(tmp_path)
    schema = schema_file(tmp_path)
    build_windows(tmp_path, logs, schema, tmp_path / "data", names=("A", "B"))
    return tmp_path / "data", logs, schema


def test_append_refuses_a_missing_directory_or_a_data_set_without_windows(tmp_path):
    logs = window_logs(tmp_path)
    schema = schema_file(tmp_path)
    with pytest.raises(GemDataError, match=r"--append: .*nowhere does not exist; import the "
                                           r"first window without --append"):
        import_logs(*logs["A"], schema, tmp_path / "nowhere", window="A", append=True)
    import_logs(*logs["A"], schema, tmp_path / "plain")
    with pytest.raises(GemDataError, match=r"plain is a data set without time windows \(written "
                                           r"by gem data import\); a window is appended only to "
                                           r"a data set imported with --window"):
        import_logs(*logs["B"], schema, tmp_path / "plain", window="B", append=True)
    with pytest.raises(GemDataError, match=r"--append adds a window .*name it with --window"):
        import_logs(*logs["B"], schema, tmp_path / "plain", append=True)
    with pytest.raises(GemDataError, match=r"window name 'a/b': use letters, digits"):
        import_logs(*logs["A"], schema, tmp_path / "new", window="a/b")


def test_append_refuses_a_window_name_taken_and_a_fresh_import_over_windows(windowed):
    out, logs, schema = windowed
    with pytest.raises(GemDataError, match=r"already has a window 'B' \(its windows: A, B\); "
                                           r"give the new window a name of its own"):
        import_logs(*logs["C"], schema, out, window="B", append=True)
    with pytest.raises(GemDataError, match=r"is a data set of windows \(A, B\): add --append to "
                                           r"add window 'C' to it"):
        import_logs(*logs["C"], schema, out, window="C")
    assert [w.name for w in read_manifest(out).windows] == ["A", "B"]


def test_append_names_the_schema_and_options_that_differ(windowed, tmp_path):
    out, logs, _ = windowed
    other = schema_file(tmp_path, SCHEMA.replace("max_seq_len = 3", "max_seq_len = 4")
                        .replace("num_embeddings = 97", "num_embeddings = 98")
                        .replace("[import]\n", "[import]\ntime_floor = 10\n")
                        + '[import.features."event.ad"]\nmissing = "default"\ndefault = 0\n',
                        name="other.toml")
    with pytest.raises(GemDataError) as error:
        import_logs(*logs["C"], other, out, window="C", append=True)
    message = str(error.value)
    assert "other.toml differs from the schema and [import] options of" in message
    for difference in ("tables['topic'].num_embeddings (97 in the data set, 98 here)",
                       "max_seq_len (3 in the data set, 4 here)",
                       "import.time_floor (0 in the data set, 10 here)",
                       'import.features."event.ad" (null in the data set, {"missing": '
                       '"default", "default": 0} here)'):
        assert difference in message, message
    # eval_fraction is not compared: windows do not use it.
    same = schema_file(tmp_path, SCHEMA.replace("eval_fraction = 0", "eval_fraction = 0.5"),
                       name="same.toml")
    assert import_logs(*logs["C"], same, out, window="C", append=True).windows[-1].name == "C"


@pytest.mark.parametrize("engine", ["numpy", "duckdb"])
@pytest.mark.parametrize("log", ["impressions", "events"])
def test_append_refuses_a_request_or_event_not_after_the_last_window(windowed, tmp_path, engine,
                                                                     log):
    if engine == "duckdb":
        pytest.importorskip("duckdb")
    out, logs, schema = windowed
    impressions, events = log_rows()
    late = [r for r in impressions if r[1] >= 3000]
    late_events = [r for r in events if r[1] >= 3000]
    if log == "impressions":
        late[2] = (late[2][0], 2950, *late[2][2:])  # at B's last time: not after it
    else:
        late_events[1] = (late_events[1][0], 2000, *late_events[1][2:])
    imp, ev = write_logs(tmp_path / "late", late, late_events)
    role, row, time = ("request time", 2, 2950) if log == "impressions" else \
        ("event time", 1, 2000)
    path = imp if log == "impressions" else ev
    with pytest.raises(GemDataError, match=rf"{path}, row {row}, column 'timestamp': {role} "
                                           rf"{time} \(1970-01-01 00:\d\d:\d\d UTC\) is not after "
                                           r"2950 \(1970-01-01 00:49:10 UTC\), the last time of "
                                           r"window 'B' of .*data \(1 such rows\)"):
        import_logs(imp, ev, schema, out, window="C", append=True, engine=engine)
    assert [w.name for w in read_manifest(out).windows] == ["A", "B"]


def test_append_refuses_text_users_after_integer_ones_and_a_damaged_tail(windowed, tmp_path):
    out, logs, schema = windowed
    impressions, events = log_rows()
    text = write_logs(tmp_path / "text", [r for r in impressions if r[1] >= 3000],
                      [r for r in events if r[1] >= 3000], text_users=True)
    with pytest.raises(GemDataError, match=r"imp\.parquet, row \d+, column 'user_id': user "
                                           r"'\w+' is text, but the data set's user ids are "
                                           r"integers"):
        import_logs(*text, schema, out, window="C", append=True)
    tail = out / read_manifest(out).windows[-1].state[0].path
    tail.write_bytes(tail.read_bytes()[:-1] + b"!")
    with pytest.raises(GemDataError, match=r"history_tail\.parquet: the history tail of window "
                                           r"'B' differs from the one the manifest records"):
        import_logs(*logs["C"], schema, out, window="C", append=True)


@pytest.mark.parametrize("engine", ["numpy", "duckdb"])
def test_text_users_stay_text_where_a_window_has_only_integer_looking_ones(tmp_path, engine):
    """Window B's users are all digits: read alone they would be integers, but the data set's
    are text, so they are numbered by the hash of their text, as one import of A and B."""
    if engine == "duckdb":
        pytest.importorskip("duckdb")
    schema = schema_file(tmp_path, 'tasks = ["click"]\nmax_seq_len = 2\n[[tables]]\nname = '
                         '"ad"\nnum_embeddings = 10\n[[event_features]]\nname = "ad"\ntable '
                         '= "ad"\n[[candidate_features]]\nname = "ad"\ntable = "ad"\n'
                         '[import]\neval_fraction = 0\n')
    logs = {"A": ("ann,100,1,1\n7,110,2,0\n", "ann,50,3\n7,60,4\n7,120,5\n"),
            "B": ("7,200,6,1\n8,210,7,0\n", "8,150,8\n7,190,9\n"),
            "all": ("ann,100,1,1\n7,110,2,0\n7,200,6,1\n8,210,7,0\n",
                    "ann,50,3\n7,60,4\n7,120,5\n8,150,8\n7,190,9\n")}
    paths = {}
    for name, (imp, ev) in logs.items():
        (tmp_path / name).mkdir()
        paths[name] = (tmp_path / name / "imp.csv", tmp_path / name / "ev.csv")
        paths[name][0].write_text("user_id,timestamp,ad,click\n" + imp)
        paths[name][1].write_text("user_id,timestamp,ad\n" + ev)
    import_logs(*paths["all"], schema, tmp_path / "one")
    build_windows(tmp_path, paths, schema, tmp_path / "windows", engine, names=("A", "B"))
    got = requests(tmp_path / "windows")
    assert got == requests(tmp_path / "one")
    assert {r["user_id"] for r in got} == {blake_id("ann"), blake_id("7"), blake_id("8")}
    assert history_times(got, blake_id("7"), 200) == [120, 190]
    # An integer column cannot be that text: refused, naming the column.
    pq.write_table(pa.table({"user_id": [9], "timestamp": [300], "ad": [1], "click": [1]}),
                   tmp_path / "int.parquet")
    with pytest.raises(GemDataError, match=r"int\.parquet, column 'user_id': the user ids are "
                                           r"integers.*but the data set's are text"):
        import_logs(tmp_path / "int.parquet", paths["B"][1], schema, tmp_path / "windows",
                    window="C", append=True, engine=engine)


# -- atomicity ----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["after_moving_the_window_in", "after_writing_its_files"])
@pytest.mark.parametrize("engine", ["numpy", "duckdb"])
def test_a_failed_append_leaves_the_data_set_as_it_was(windowed, monkeypatch, where, engine):
    if engine == "duckdb":
        pytest.importorskip("duckdb")
    out, logs, schema = windowed
    before = snapshot(out)
    beside = sorted(p.name for p in out.parent.iterdir())
    from gem_data import windows

    if where == "after_moving_the_window_in":
        def fail(directory, *args, **kwargs):
            assert (Path(directory) / "windows" / "C" / "train-00000.parquet").is_file()
            raise KeyboardInterrupt  # an interrupt, just before the manifest is replaced

        monkeypatch.setattr(windows, "publish_windows", fail)
        expected = KeyboardInterrupt
    else:
        finish = windows.WindowWriter.window

        def fail(self, **kwargs):
            finish(self, **kwargs)  # the requests and the tail are written
            assert {p.name for p in self.folder.iterdir()} == {"train-00000.parquet",
                                                               "history_tail.parquet"}
            raise OSError("No space left on device")

        monkeypatch.setattr(windows.WindowWriter, "window", fail)
        expected = OSError
    with pytest.raises(expected):
        import_logs(*logs["C"], schema, out, window="C", append=True, engine=engine)
    assert snapshot(out) == before  # every file, byte for byte; no window folder left
    assert sorted(p.name for p in out.parent.iterdir()) == beside  # no work directory left
    DatasetReader(out)  # readable: no Parquet file the manifest does not list
    monkeypatch.undo()
    manifest = import_logs(*logs["C"], schema, out, window="C", append=True, engine=engine)
    assert [w.name for w in manifest.windows] == ["A", "B", "C"]


# -- inspect and validate -----------------------------------------------------------------------


def test_inspect_lists_the_windows_and_validate_checks_the_state_files(windowed):
    out, _, _ = windowed
    result = CliRunner().invoke(data_group, ["inspect", str(out)])
    assert result.exit_code == 0, result.output
    assert "window A: 1970-01-01T00:20:00+00:00 .. 1970-01-01T00:32:30+00:00 (1200 .. 1950 s), " \
           "3 requests, 6 history events; state: windows/A/history_tail.parquet (6 rows, " \
        in result.output
    assert "window B: 1970-01-01T00:35:00+00:00 .. 1970-01-01T00:49:10+00:00 (2100 .. 2950 s), " \
           "3 requests" in result.output
    info = json.loads(CliRunner().invoke(data_group, ["inspect", str(out), "--json"]).output)
    a, b = info["windows"]
    assert (a["name"], a["first_time"], a["first_time_utc"], a["requests"]) == \
        ("A", 1200, "1970-01-01T00:20:00+00:00", 3)
    assert b["files"] == ["windows/B/train-00000.parquet"]
    assert b["state"][0]["path"] == "windows/B/history_tail.parquet" and b["state"][0]["rows"]
    assert a["history_events"] + b["history_events"] == info["splits"]["train"]["history_events"]

    result = CliRunner().invoke(data_group, ["validate", str(out)])
    assert result.exit_code == 0, result.output
    assert "2 files (and 2 state files), 2 of 2 row groups" in result.output
    tail = out / "windows" / "A" / "history_tail.parquet"
    tail.write_bytes(tail.read_bytes()[:-1] + b"!")
    result = CliRunner().invoke(data_group, ["validate", str(out), "--json"])
    assert result.exit_code == 1
    report = json.loads(result.output)
    assert report["files_damaged"] == ["windows/A/history_tail.parquet"]
    assert f"{tail}: SHA-256" in report["errors"][0]
    tail.unlink()
    report = json.loads(CliRunner().invoke(data_group, ["validate", str(out), "--json"]).output)
    assert report["files_unreadable"] == ["windows/A/history_tail.parquet"]
    assert "state file listed in the manifest does not exist" in report["errors"][0]
    assert (out / MANIFEST_NAME).is_file()
