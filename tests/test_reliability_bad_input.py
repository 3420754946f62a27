"""Bad input end to end: every bad case the validator knows, in a Parquet data set (format 2: one
row per request) with good rows around it, either stops ``gem train`` with an error naming file,
row and feature (policy ``error``) or gives a finished run whose summary.json counts exactly the
dropped or repaired rows (policies ``drop``, ``clamp`` and ``trim``). Then hypothesis-generated
data sets through the loader and validator, for a bounded time."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gem_core.errors import GemDataError
from gem_data import format as fmt
from gem_data.arrow_io import batch_to_table
from gem_data.dataset import DatasetReader, split_units
from gem_data.generator import AdsLogGenerator, synthetic_ads_schema
from gem_data.loader import ParquetStream
from gem_data.synth_options import SynthOptions
from gem_data.validation import CHECKS, ValidationPolicy, ValidationReport, check_batch
from gem_data.writer import DatasetWriter

OPTIONS = SynthOptions(num_items=500, num_users=200, num_clusters=8, num_advertisers=20,
                       mean_length=12.0, max_length=64)
SCHEMA = synthetic_ads_schema(OPTIONS)
TRAIN_ROWS, GROUP_ROWS, EVAL_ROWS = 256, 64, 256
FILE = "train-00000.parquet"

# The synthetic-ads 'ad' table takes any 64-bit id (policy 'hash'): the out-of-range cases spoil
# features of 'dense'-policy tables (advertiser: 20 rows, category: 8, action: 3, context: 16).
assert SCHEMA.table("ad").id_policy == "hash"
assert all(SCHEMA.table(t).id_policy == "dense"
           for t in ("advertiser", "category", "action", "context"))
assert SCHEMA.table("advertiser").num_embeddings == 20
assert SCHEMA.table("category").num_embeddings == 8
assert SCHEMA.table("context").num_embeddings == 16
# No synthetic-ads feature is multi-valued, so the "empty id list of a multi-valued feature" case
# has no column to spoil here (packages/gem-data/tests/test_validation.py covers it).
assert not any(f.multi_valued for f in (*SCHEMA.event_features, *SCHEMA.candidate_features))

EVENT_COLUMNS = [fmt.event_column(f.name) for f in SCHEMA.event_features]
CANDIDATE_COLUMNS = [fmt.candidate_column(f.name) for f in SCHEMA.candidate_features]
LABEL_COLUMNS = [fmt.label_column(task) for task in SCHEMA.tasks]


def _last_event(row: dict, column: str, value: Any) -> None:
    """Set the most recent event's ``column`` to ``value`` (``value(row)`` if callable)."""
    if not row[fmt.HISTORY_TIMESTAMP]:  # give an empty history one valid event to spoil
        for name in EVENT_COLUMNS:
            row[name] = [0]  # valid in every table (the ad table takes any id)
        row[fmt.HISTORY_TIMESTAMP] = [row[fmt.REQUEST_TIMESTAMP] - 1]
    row[column][-1] = value(row) if callable(value) else value


def _event(column: str, value: Any) -> Callable[[dict], None]:
    return lambda row: _last_event(row, column, value)


def _set(column: str, value: Any) -> Callable[[dict], None]:
    return lambda row: row.__setitem__(column, value)


def _candidates(column: str, value: Any) -> Callable[[dict], None]:
    """Every candidate's ``column`` set to ``value``."""
    return lambda row: row.__setitem__(column, [value] * len(row[column]))


def _last_candidate(column: str, value: Any) -> Callable[[dict], None]:
    return lambda row: row[column].__setitem__(-1, value)


def _dense(index: int, value: float) -> Callable[[dict], None]:
    return lambda row: row["dense"].__setitem__(index, value)


def _ragged(row: dict) -> None:
    _last_event(row, "event.action", 0)
    row["event.action"] = row["event.action"][:-1]


def _no_candidates(row: dict) -> None:
    for name in (*CANDIDATE_COLUMNS, *LABEL_COLUMNS):
        row[name] = []


def _extra_label(row: dict) -> None:
    row["label.click"] = row["label.click"] + [0.0]


# name: (validation check, feature named in the error, how a row is spoiled)
BAD_CASES: dict[str, tuple[str, str, Callable[[dict], None]]] = {
    "candidate-id-too-large": ("ids", "candidate.category", _candidates("candidate.category", 8)),
    "negative-history-id": ("ids", "event.advertiser", _event("event.advertiser", -3)),
    "candidate-feature-out-of-range": ("ids", "candidate.advertiser",
                                       _last_candidate("candidate.advertiser", 20)),
    "sparse-id-out-of-range": ("ids", "sparse.context", _set("sparse.context", [3, 16])),
    "nan-dense": ("dense", "dense", _dense(1, math.nan)),
    "infinite-dense": ("dense", "dense", _dense(0, -math.inf)),
    "ragged-history": ("structure", "event.action", _ragged),
    "no-candidates": ("structure", "candidate.ad_id", _no_candidates),
    "label-count-differs": ("structure", "label.click", _extra_label),
    "label-two": ("labels", "label.click", _last_candidate("label.click", 2.0)),
    "nan-label": ("labels", "label.conversion", _last_candidate("label.conversion", math.nan)),
    "future-event": ("time", fmt.HISTORY_TIMESTAMP,
                     _event(fmt.HISTORY_TIMESTAMP, lambda row: row[fmt.REQUEST_TIMESTAMP] + 60)),
}


def write_dataset(out: Path, faults: dict[int, str], *, rows: int = TRAIN_ROWS,
                  group_rows: int = GROUP_ROWS, eval_rows: int = EVAL_ROWS,
                  seed: int = 3) -> Path:
    """A generated data set with ``faults`` (train row -> bad case) written into the train
    split through the real writer; every other row is good."""
    generator = AdsLogGenerator(OPTIONS, seed=seed)
    table = batch_to_table(generator.chunk(rows, split="train", index=0), generator.schema)
    records = table.to_pylist()
    for row, case in faults.items():
        BAD_CASES[case][2](records[row])
    writer = DatasetWriter(out, generator.schema, row_group_rows=group_rows)
    writer.write("train", type(table).from_pylist(records, schema=table.schema))
    writer.write("eval", generator.chunk(eval_rows, split="eval", index=0))
    writer.close()
    return out


def _train_args(data: Path, out: Path, policy: dict[str, str]) -> list[str]:
    args = ["train", "--out", str(out), "--data", "parquet", "--set", f"data.path={data}",
            "--set", "train.steps=8", "--set", "train.batch_size=32",
            "--set", f"data.eval_rows={EVAL_ROWS}", "--set", f"train.eval_batch_size={EVAL_ROWS}",
            "--set", "train.warmup_steps=1", "--set", "train.eval_every=0",
            "--set", "train.checkpoint_every=0", "--set", "data.max_seq_len=16",
            "--set", "model.interaction_dims=[16]", "--no-progress"]
    for check, mode in policy.items():
        args += ["--set", f"data.options.validation.{check}={mode}"]
    return args


BAD_ROW = 77  # row 13 of row group 1: good rows on both sides and in other groups


def _first_error(data: Path) -> str:
    """The error the default (strict) policy stops at, reading the train split as the trainer's
    loader does (the same reader and checks, in this process)."""
    reader = DatasetReader(data, max_seq_len=16)
    with pytest.raises(GemDataError) as error:
        for unit in split_units(reader.manifest, "train"):
            reader.read(unit)
    return str(error.value)


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_policy_error_names_file_row_and_feature(tmp_path, case):
    data = write_dataset(tmp_path / "data", {BAD_ROW: case})
    check, feature, _ = BAD_CASES[case]
    message = _first_error(data)
    assert FILE in message and "row group 1" in message, message
    assert f"row {BAD_ROW} " in message and f"'{feature}'" in message, message
    assert f"data.options.validation.{check} = 'error'" in message


def test_training_on_bad_data_stops_with_that_error_and_no_traceback(gem, tmp_path):
    """``gem train`` surfaces the reader's message as it is (each case's message is checked
    above, in process)."""
    data = write_dataset(tmp_path / "data", {BAD_ROW: "nan-dense"})
    result = gem(*_train_args(data, tmp_path / "run", {}))
    assert result.returncode != 0
    assert _first_error(data) in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


# One data set with every bad case, spread over the four row groups, good rows in between.
_SPACING = TRAIN_ROWS // len(BAD_CASES)
ALL_FAULTS = {row: case for row, case in zip(range(_SPACING // 2, TRAIN_ROWS, _SPACING),
                                             sorted(BAD_CASES))}
assert len(ALL_FAULTS) == len(BAD_CASES)
assert {row // GROUP_ROWS for row in ALL_FAULTS} == set(range(TRAIN_ROWS // GROUP_ROWS))


def _expected(policy: dict[str, str]) -> tuple[dict[str, int], dict[str, int]]:
    dropped = dict.fromkeys(CHECKS, 0)
    repaired = dict(dropped)
    for case in ALL_FAULTS.values():
        check = BAD_CASES[case][0]
        (dropped if policy[check] == "drop" else repaired)[check] += 1
    return dropped, repaired


@pytest.mark.parametrize("policy", [
    {"structure": "drop", "ids": "drop", "dense": "drop", "labels": "drop", "time": "drop"},
    {"structure": "drop", "ids": "clamp", "dense": "clamp", "labels": "drop", "time": "trim"},
], ids=["drop", "clamp-trim"])
def test_drop_and_clamp_finish_with_exact_counts(gem, tmp_path, policy):
    data = write_dataset(tmp_path / "data", ALL_FAULTS)
    out = tmp_path / "run"
    result = gem(*_train_args(data, out, policy))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["finished"]
    report = summary["data"]
    dropped, repaired = _expected(policy)
    assert report["rows_dropped"] == dropped
    assert report["rows_repaired"] == repaired
    assert report["total_dropped"] + report["total_repaired"] == len(ALL_FAULTS)
    assert report["rows_checked"] == TRAIN_ROWS + EVAL_ROWS  # every row group was read
    for task in ("click", "conversion"):
        assert math.isfinite(summary["eval"][task]["ne"])


# -- fuzzing the loader and validator -------------------------------------------------------

MODES = {"structure": ("error", "drop"), "ids": ("error", "drop", "clamp"),
         "dense": ("error", "drop", "clamp"), "labels": ("error", "drop"),
         "time": ("error", "drop", "trim")}
assert set(MODES) == set(CHECKS)


@st.composite
def data_sets(draw):
    rows = draw(st.integers(8, 48))
    faults = draw(st.dictionaries(st.integers(0, rows - 1), st.sampled_from(sorted(BAD_CASES)),
                                  max_size=6))
    policy = {check: draw(st.sampled_from(MODES[check])) for check in CHECKS}
    return rows, draw(st.integers(3, 16)), faults, policy, draw(st.integers(0, 1000))


@settings(max_examples=40, deadline=5000, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data_sets())
def test_fuzzed_parquet_through_loader_and_validator(case):
    rows, group_rows, faults, policy, seed = case
    with tempfile.TemporaryDirectory() as scratch:
        directory = write_dataset(Path(scratch) / "data", faults, rows=rows,
                                  group_rows=group_rows, eval_rows=4, seed=seed)
        report = ValidationReport()
        reader = DatasetReader(directory, policy=ValidationPolicy(**policy), report=report)
        stream = ParquetStream(reader, split_units(reader.manifest, "train"), batch_size=7,
                               seed=seed, shuffle=False, epochs=1, prefetch=0)
        by_group: dict[int, list[tuple[int, str]]] = {}
        for row, name in sorted(faults.items()):
            by_group.setdefault(row // group_rows, []).append((row, name))
        failing = [(group, items) for group, items in sorted(by_group.items())
                   if any(policy[BAD_CASES[n][0]] == "error" for _, n in items)]
        try:
            batches = list(stream)
        except GemDataError as error:
            assert failing, f"unexpected error: {error}"
            group, items = failing[0]  # row groups are read in order: the first one fails
            check = next(c for c in CHECKS
                         if any(BAD_CASES[n][0] == c and policy[c] == "error" for _, n in items))
            message = str(error)
            assert FILE in message and f"row group {group}," in message, message
            assert any(f"row {row} " in message and f"'{BAD_CASES[n][1]}'" in message
                       for row, n in items if BAD_CASES[n][0] == check), message
            return
        finally:
            stream.close()
        assert not failing, "a bad row under policy 'error' was accepted"
        expected_drop = sum(policy[BAD_CASES[n][0]] == "drop" for n in faults.values())
        assert sum(b.batch_size for b in batches) == rows - expected_drop  # no silent loss
        counts = report.to_dict()
        assert counts["total_dropped"] == expected_drop
        assert counts["total_repaired"] == len(faults) - expected_drop
        for batch in batches:
            check_batch(batch, reader.schema)  # what reaches the model is valid
