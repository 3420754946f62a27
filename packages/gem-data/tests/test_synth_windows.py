"""``gem data synth --windows``: consecutive time windows of a drifting synthetic ads log, with
new ads per window and each window's ground truth (true probabilities, achievable and stale
NE)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import attrs
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from gem_core.errors import GemDataError
from gem_data import format as fmt
from gem_data.cli import data_group
from gem_data.generator import (
    TASKS,
    AdsLogGenerator,
    normalized_entropy_of_probabilities,
)
from gem_data.manifest import read_manifest
from gem_data.synth_options import SynthOptions
from gem_data.synth_windows import (
    NEW_ADS_FILE,
    WINDOW_DRIFT,
    probability_column,
    synthesize_windows,
    window_probabilities,
    window_synth_options,
)

SMALL = {"num_items": 400, "num_users": 400, "max_candidates": 4, "max_length": 24}
WINDOWS, ROWS = 6, 1200
LAYOUT = {"chunk_rows": 500, "row_group_rows": 256, "file_rows": 700}  # 3 chunks, 2 files


def _write(out: Path, seed: int = 0, **options) -> None:
    synthesize_windows(out, windows=WINDOWS, window_rows=ROWS, seed=seed,
                       options=window_synth_options({**SMALL, **options}),
                       new_ads_per_window=0.1, **LAYOUT)


@pytest.fixture(scope="module")
def drifting(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("windows") / "ads"
    _write(out)
    return out


def _window_table(directory: Path, window) -> pa.Table:
    return pa.concat_tables([pq.read_table(directory / path) for path in window.files])


def _ids(table: pa.Table, column: str) -> np.ndarray:
    return pc.list_flatten(table.column(column)).to_numpy()


def test_windows_read_back_consecutive_in_time_order(drifting):
    manifest = read_manifest(drifting)  # the manifest's window checks pass
    assert [w.name for w in manifest.windows] == [f"day-{w:03d}" for w in range(WINDOWS)]
    assert "eval" not in manifest.splits
    previous_last = None
    for w, window in enumerate(manifest.windows):
        assert len(window.files) == 2 and manifest.window_rows(window) == ROWS
        table = _window_table(drifting, window)
        requests = table.column(fmt.REQUEST_TIMESTAMP).to_numpy()
        assert (np.diff(requests) >= 0).all()  # in time order, across chunks and files
        day = 1_700_000_000 + w * 86_400
        assert day <= requests.min() and requests.max() < day + 86_400
        assert window.first_time == requests.min() and window.last_time == day + 86_399
        events = _ids(table, fmt.HISTORY_TIMESTAMP)
        assert events.max() < requests.max()
        if previous_last is not None:
            assert window.first_time > previous_last
            assert (events < day).any()  # histories reach back into earlier days
        previous_last = window.last_time
        assert window.info["time"] == w and window.info["rows"] == ROWS


def test_new_ads_are_unseen_before_and_keep_their_attributes(drifting):
    manifest = read_manifest(drifting)
    generator = AdsLogGenerator(SynthOptions(**SMALL), seed=0)
    known = set(generator.ad_ids.tolist())  # the catalogue
    seen: set[int] = set()
    for w, window in enumerate(manifest.windows):
        table = _window_table(drifting, window)
        shown = _ids(table, fmt.candidate_column("ad_id"))
        events = _ids(table, fmt.event_column("ad_id"))
        new = pq.read_table(drifting / next(e.path for e in window.state
                                            if e.path.endswith(NEW_ADS_FILE)))
        new_ids = new.column("ad_id").to_numpy()
        assert len(new_ids) == (0 if w == 0 else 40) == window.info["new_ads"]
        assert not seen & set(new_ids.tolist())  # never shown, nor in a history, before
        is_new = np.isin(shown, new_ids)
        assert is_new.any() == (w > 0)
        assert window.info["new_ad_impressions"] == pytest.approx(is_new.mean())
        # Every other ad comes from the catalogue or was new in an earlier window.
        assert set(shown.tolist()) | set(events.tolist()) <= known | set(new_ids.tolist())
        attributes = dict(zip(new_ids.tolist(), zip(new.column("advertiser").to_pylist(),
                                                    new.column("category").to_pylist())))
        advertisers = _ids(table, fmt.candidate_column("advertiser"))
        categories = _ids(table, fmt.candidate_column("category"))
        for i in np.flatnonzero(is_new):
            assert attributes[shown[i]] == (advertisers[i], categories[i])
        known |= set(new_ids.tolist())
        seen |= set(shown.tolist()) | set(events.tolist())


def test_probabilities_align_with_labels_and_give_the_achievable_ne(drifting):
    for window in read_manifest(drifting).windows:
        table = _window_table(drifting, window)
        truth = window_probabilities(drifting, window)
        assert truth.num_rows == table.num_rows
        np.testing.assert_array_equal(truth.column(fmt.REQUEST_TIMESTAMP).to_numpy(),
                                      table.column(fmt.REQUEST_TIMESTAMP).to_numpy())
        for task in TASKS:
            p, labels = truth.column(probability_column(task)), table.column(
                fmt.label_column(task))
            assert pc.list_value_length(p).equals(pc.list_value_length(labels))
            values = pc.list_flatten(p).to_numpy()
            assert ((values > 0) & (values < 1)).all()
            ne = normalized_entropy_of_probabilities(values, pc.list_flatten(labels).to_numpy())
            assert ne == pytest.approx(window.info["achievable_ne"][task], rel=1e-12)
        click = pc.list_flatten(truth.column(probability_column("click"))).to_numpy()
        conversion = pc.list_flatten(truth.column(probability_column("conversion"))).to_numpy()
        assert (conversion <= click).all()


def test_a_model_of_window_zero_goes_stale(drifting, tmp_path):
    windows = read_manifest(drifting).windows
    gap = [w.info["stale_ne"]["click"] - w.info["achievable_ne"]["click"] for w in windows]
    assert gap[0] == 0.0  # window 0 is the process the stale reference knows
    # Worse on every later window, by far on the last ones (4/24 and 5/24 of a turn of the
    # drift there); the middle windows' gaps are small and noisy on 2000 impressions.
    assert all(g > 0 for g in gap[1:]) and min(gap[-2:]) > 0.05
    _write(tmp_path / "still", drift_weight=0.0)
    for window in read_manifest(tmp_path / "still").windows:
        assert window.info["stale_ne"] == window.info["achievable_ne"]


def test_probabilities_at_another_time_are_that_process():
    options = SynthOptions(**SMALL, drift_weight=1.0, drift_period=10.0)
    later = AdsLogGenerator(attrs.evolve(options, eval_time=7), seed=4)
    chunk = later.chunk_with_indicators(200, split="eval", index=0)
    now = AdsLogGenerator(options, seed=4).chunk_with_probabilities(200, split="eval", index=0)
    moved = later.probabilities_at(chunk, drawn_at=7, time=0)
    for task in TASKS:
        np.testing.assert_allclose(moved[task], now[1][task], rtol=1e-10)
        assert not np.allclose(chunk.probabilities[task], now[1][task])


def _digests(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_the_same_options_write_the_same_bytes(drifting, tmp_path):
    _write(tmp_path / "again")
    assert _digests(tmp_path / "again") == _digests(drifting)
    _write(tmp_path / "other", seed=1)
    assert _digests(tmp_path / "other") != _digests(drifting)


def test_bad_options_are_refused(tmp_path):
    with pytest.raises(GemDataError, match="eval_time does not apply to --windows"):
        synthesize_windows(tmp_path / "a", windows=2, window_rows=10, seed=0,
                           options=window_synth_options({**SMALL, "eval_time": 3}))
    with pytest.raises(GemDataError, match="new_ads_per_window"):
        synthesize_windows(tmp_path / "a", windows=2, window_rows=10, seed=0,
                           new_ads_per_window=1.0)


def test_the_synth_command_writes_windows(tmp_path):
    out = tmp_path / "cli"
    command = ["synth", "--out", str(out), "--windows", "3", "--window-rows", "300",
               "--new-ads", "0.2", "--seed", "2", "--row-group-rows", "128",
               *[arg for key, value in SMALL.items() for arg in ("--set", f"{key}={value}")]]
    result = CliRunner().invoke(data_group, command)
    assert result.exit_code == 0, result.output
    assert "wrote 3 windows of 300 requests" in result.output
    manifest = read_manifest(out)
    assert len(manifest.windows) == 3 and manifest.rows("train") == 900
    assert manifest.info["options"]["drift_weight"] == WINDOW_DRIFT["drift_weight"]
    assert manifest.info["new_ads_per_window"] == 0.2
    assert manifest.windows[1].info["new_ads"] == 80
    assert CliRunner().invoke(data_group, ["validate", str(out)]).exit_code == 0
    # --set overrides the window drift defaults.
    result = CliRunner().invoke(data_group, [*command, "--set", "drift_weight=0"])
    assert result.exit_code == 0, result.output
    still = json.loads((out / "manifest.json").read_text())
    assert still["info"]["options"]["drift_weight"] == 0.0
    for refused in (["--eval-rows", "100"], ["--rows", "5"]):
        result = CliRunner().invoke(data_group, [*command, *refused])
        assert result.exit_code == 2 and "do not apply with --windows" in result.output
    result = CliRunner().invoke(data_group, ["synth", "--out", str(out), "--window-rows", "5"])
    assert result.exit_code == 2 and "need --windows" in result.output
