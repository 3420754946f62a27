"""``gem data synth --windows N``: the synthetic ads log as N consecutive time windows (days).

Window ``w`` (``day-000``, ``day-001``, ...) holds ``window_rows`` requests at seconds
``start_time + w * window_seconds <= t < start_time + (w + 1) * window_seconds``, in time order;
their histories reach back into earlier days, as real histories do. What changes from window to
window, so that a model trained on early windows goes stale on late ones:

- **drift**: the labels of window ``w`` come from the planted process at time ``w``
  (:meth:`~gem_data.generator.AdsLogGenerator.window_chunk`): ``drift_period`` counts windows.
  Without ``--set drift_weight=...`` the windows drift by :data:`WINDOW_DRIFT` (``gem data synth``
  without ``--windows`` keeps the generator's stationary default).
- **new ads**: at the start of each window after the first, a share ``new_ads_per_window`` of the
  catalogue's ads is replaced by new ads: a fresh raw id (never seen before, in no earlier
  window's candidates or histories) with the replaced ad's advertiser, category, topics and
  content, shown from then on wherever the old one would have been (a history event shows the ad
  of its own time). The labels depend on attributes only, so the new ids change no probability:
  a model must carry what it learned about the advertiser and category over to unseen ids.

Each window records its ground truth: the state file ``probabilities.parquet`` (per request, in
the order of the window's requests, ``request_timestamp`` and one list per task of every
impression's true probability, ``probability.<task>``, aligned with ``label.<task>``), the state
file ``new_ads.parquet`` (the ads launched in the window) and, in the window's ``info``,
``achievable_ne`` (the NE of those probabilities on the window's labels: the floor of a model
evaluated on the window) and ``stale_ne`` (the NE of the process as it was at window 0 on the
same impressions: a perfect model that never followed the drift).

The data set has no eval split: a streaming run evaluates each window before training on it
(``--eval-rows`` with ``--windows`` is refused). Requests are generated in chunks of
:data:`CHUNK_ROWS` whatever the row groups, so every file is a pure function of the seed, the
options and the window counts.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pyarrow as pa

from gem_core.errors import GemDataError
from gem_data import format as fmt
from gem_data.generator import (
    TASKS,
    AdsLogGenerator,
    normalized_entropy_of_probabilities,
)
from gem_data.manifest import MANIFEST_NAME, Manifest, TimeWindow
from gem_data.synth_options import SynthOptions
from gem_data.windows import WindowWriter, publish_windows

WINDOW_DRIFT = {"drift_weight": 0.8, "drift_period": 24.0}
"""The drift of a windowed data set unless ``--set`` says otherwise: a full turn of the
category preferences in 24 windows, so window 7 is 7/24 of a turn (105 degrees) from window 0:
a perfect model of window 0 is then about 0.17 click NE above the truth, one of window 6 about
0.005 (measured: docs/data-format.md)."""

NEW_ADS_PER_WINDOW = 0.05
"""Default share of the catalogue's ads replaced by new ads at each window after the first."""

CHUNK_ROWS = 4096
"""Requests generated at once (a window's last chunk is shorter)."""

START_TIME = 1_700_000_000
"""Start of window 0, seconds (the plain data set's requests start there too)."""

PROBABILITIES_FILE = "probabilities.parquet"
NEW_ADS_FILE = "new_ads.parquet"


def probability_column(task: str) -> str:
    """Column of ``task``'s true probabilities in :data:`PROBABILITIES_FILE`."""
    return f"probability.{task}"


def window_name(window: int, windows: int) -> str:
    """``day-000``, ...: zero-padded so names sort in time order."""
    return f"day-{window:0{max(3, len(str(windows - 1)))}d}"


class AdRotation:
    """Which ad each catalogue slot shows in each window: slot ``i`` shows generation
    ``generation[w, i]`` (0: the catalogue's ad) during window ``w``. At each window after the
    first, ``round(share * num_items)`` slots, drawn uniformly from the seed's own stream, move
    to their next generation: a new ad."""

    def __init__(self, generator: AdsLogGenerator, *, windows: int, share: float,
                 start_time: int, window_seconds: int) -> None:
        self.generator = generator
        self.start_time, self.window_seconds = start_time, window_seconds
        n = generator.options.num_items
        rng = np.random.default_rng([generator.seed, 8])  # a stream no other draw uses
        self.generation = np.zeros((windows, n), dtype=np.int64)
        self.launched: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
        for w in range(1, windows):
            slots = np.sort(rng.choice(n, size=round(share * n), replace=False))
            self.generation[w] = self.generation[w - 1]
            self.generation[w, slots] += 1
            self.launched.append(slots)

    def window_of(self, times: np.ndarray) -> np.ndarray:
        """The window of each time (seconds); times before window 0 count as window 0 (whose
        ads are the catalogue's)."""
        window = (np.asarray(times) - self.start_time) // self.window_seconds
        return np.clip(window, 0, self.generation.shape[0] - 1)

    def ad_ids(self, items: np.ndarray, times: np.ndarray) -> np.ndarray:
        """Raw id of each ad slot at each time: that of its generation then."""
        return self.generator.ad_id(items, self.generation[self.window_of(times), items])

    def new_ads(self, window: int) -> np.ndarray:
        """The slots that show a new ad from ``window`` on (none in window 0)."""
        return self.launched[window]


def window_synth_options(values: dict[str, Any] | None = None) -> SynthOptions:
    """Generator options of a windowed data set: :data:`WINDOW_DRIFT` unless ``values`` (the
    ``--set`` options) name the drift fields themselves."""
    from gem_core.config import structure

    return structure(SynthOptions, {**WINDOW_DRIFT, **(values or {})}, "synth")


def synthesize_windows(out: str | Path, *, windows: int, window_rows: int, seed: int,
                       options: SynthOptions | None = None,
                       new_ads_per_window: float = NEW_ADS_PER_WINDOW,
                       window_seconds: int = 86_400, start_time: int = START_TIME,
                       row_group_rows: int = 16384, file_rows: int = 1 << 20,
                       chunk_rows: int = CHUNK_ROWS) -> Manifest:
    """Write ``windows`` windows of ``window_rows`` requests each into ``out`` (see the module
    documentation); ``options`` default to :func:`window_synth_options`. ``row_group_rows``
    and ``file_rows`` only lay the requests out; ``chunk_rows`` (the requests generated at
    once) changes them, so the manifest records it."""
    options = options if options is not None else window_synth_options()
    _check(options, windows=windows, window_rows=window_rows, share=new_ads_per_window,
           window_seconds=window_seconds, chunk_rows=chunk_rows)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stale = out / MANIFEST_NAME
    if stale.exists():
        stale.unlink()  # the directory is being rewritten: it is not a data set until the end
    generator = AdsLogGenerator(options, seed=seed)
    rotation = AdRotation(generator, windows=windows, share=new_ads_per_window,
                          start_time=start_time, window_seconds=window_seconds)
    written: list[TimeWindow] = []
    entries = []
    for w in range(windows):
        writer = WindowWriter(out, generator.schema, window_name(w, windows),
                              row_group_rows=row_group_rows, file_rows=file_rows)
        begin = start_time + w * window_seconds
        info = _write_window(writer, generator, rotation, w, begin, window_rows, window_seconds,
                             chunk_rows)
        written.append(writer.window(info=info, last_time=begin + window_seconds - 1))
        entries += writer.entries
    info = {"source": "gem data synth", "seed": seed, "windows": windows,
            "window_rows": window_rows, "window_seconds": window_seconds,
            "start_time": start_time, "new_ads_per_window": new_ads_per_window,
            "row_group_rows": row_group_rows, "chunk_rows": chunk_rows,
            "options": attrs.asdict(options)}
    return publish_windows(out, generator.schema, written, entries, info=info)


def _check(options: SynthOptions, *, windows: int, window_rows: int, share: float,
           window_seconds: int, chunk_rows: int) -> None:
    counts = {"windows": windows, "window_rows": window_rows, "window_seconds": window_seconds,
              "chunk_rows": chunk_rows}
    for name, value in counts.items():
        if value < 1:
            raise GemDataError(f"{name} is {value}: it must be at least 1")
    if not 0.0 <= share < 1.0:
        raise GemDataError(f"new_ads_per_window {share} must be in [0, 1): the share of the "
                           "catalogue's ads replaced by new ads at each window")
    for name in ("train_start", "eval_time"):  # they place a plain data set's chunks in time
        if getattr(options, name):
            raise GemDataError(f"synth option {name} does not apply to --windows: window w's "
                               "requests are drawn at time w (drift_period counts windows)")


def _write_window(writer: WindowWriter, generator: AdsLogGenerator, rotation: AdRotation,
                  w: int, begin: int, rows: int, seconds: int, chunk_rows: int
                  ) -> dict[str, Any]:
    """Write window ``w``'s requests and state files; its ``info``."""
    truth: dict[str, list[np.ndarray]] = {task: [] for task in TASKS}
    stale: dict[str, list[np.ndarray]] = {task: [] for task in TASKS}
    labels: dict[str, list[np.ndarray]] = {task: [] for task in TASKS}
    offsets, times, shown = [np.zeros(1, dtype=np.int64)], [], []
    for index, low in enumerate(range(0, rows, chunk_rows)):
        high = min(low + chunk_rows, rows)
        # Chunk after chunk through the day, so the window's requests are in time order.
        chunk = generator.window_chunk(high - low, window=w, index=index,
                                       start=begin + seconds * low // rows,
                                       stop=begin + seconds * high // rows,
                                       ad_ids=rotation.ad_ids)
        writer.write(chunk.batch)
        before = generator.probabilities_at(chunk, drawn_at=w, time=0)
        for task in TASKS:
            truth[task].append(chunk.probabilities[task])
            stale[task].append(before[task])
            labels[task].append(chunk.batch.labels[task].numpy())
        counts = np.diff(chunk.batch.candidate_offsets.numpy())
        offsets.append(offsets[-1][-1] + np.cumsum(counts))
        times.append(chunk.batch.request_timestamps.numpy())
        shown.append(chunk.batch.candidate_ids["ad_id"].numpy())
    list_offsets = pa.array(np.concatenate(offsets), type=pa.int32())
    columns = {fmt.REQUEST_TIMESTAMP: pa.array(np.concatenate(times), type=pa.int64())}
    for task in TASKS:
        columns[probability_column(task)] = pa.ListArray.from_arrays(
            list_offsets, pa.array(np.concatenate(truth[task]), type=pa.float64()))
    writer.write_state(PROBABILITIES_FILE, pa.table(columns))
    slots = rotation.new_ads(w)
    new_ids = generator.ad_id(slots, rotation.generation[w, slots])
    writer.write_state(NEW_ADS_FILE, pa.table({
        "ad_id": pa.array(new_ids, type=pa.int64()),
        "advertiser": pa.array(generator.item_advertiser[slots], type=pa.int64()),
        "category": pa.array(generator.item_cluster[slots], type=pa.int64())}))
    shown_ids = np.concatenate(shown)
    return {
        "time": w, "rows": rows, "impressions": int(shown_ids.size),
        "achievable_ne": _ne(truth, labels), "stale_ne": _ne(stale, labels),
        "new_ads": int(slots.size),
        "new_ad_impressions": float(np.isin(shown_ids, new_ids).mean()),
    }


def _ne(probabilities: dict[str, list[np.ndarray]], labels: dict[str, list[np.ndarray]]
        ) -> dict[str, float | None]:
    """Per task, the NE of ``probabilities`` on ``labels``; None where it is undefined (the
    window's labels of that task are all 0), so the manifest stays plain JSON."""
    out: dict[str, float | None] = {}
    for task in TASKS:
        ne = normalized_entropy_of_probabilities(np.concatenate(probabilities[task]),
                                                 np.concatenate(labels[task]))
        out[task] = None if math.isnan(ne) else ne
    return out


def window_probabilities(directory: str | Path, window: TimeWindow) -> pa.Table:
    """The :data:`PROBABILITIES_FILE` state table of ``window`` of the data set ``directory``."""
    import pyarrow.parquet as pq

    for entry in window.state:
        if Path(entry.path).name == PROBABILITIES_FILE:
            return pq.read_table(Path(directory) / entry.path)
    raise GemDataError(f"window {window.name!r} has no {PROBABILITIES_FILE} (not written by "
                       "gem data synth --windows)")
