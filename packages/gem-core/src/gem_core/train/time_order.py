"""Training on a stream of logs (``data.order = "time"``): the windows once, oldest first, with
progressive evaluation.

Before the model trains on window ``T + 1`` it is evaluated on it, exactly as it will be used:
trained on everything up to ``T``, scoring what comes next. Those evaluations (one per window
after the first) are the run's evaluations: ``eval.jsonl`` and ``summary.json`` hold one entry
per window with its name, and the headline is their mean (the *progressive* NE). Nothing is held
out and ``train.eval_every`` does not apply.

The run ends when the windows do (or at ``train.steps``, a cap) with a checkpoint at the end of
each window. When the data set gains windows, ``gem train`` with the same ``--out`` continues at
the first new one without ``--allow-data-change`` (the data fingerprint lists the windows, and
the checkpoint's must be the start of the current list): the result is the same, bit for bit, as
one run over all the windows. Early stopping, more than one epoch and a learning rate decaying
towards ``train.steps`` have no meaning on a stream that keeps growing, and are refused.
"""

from __future__ import annotations

import logging
import math
import statistics
from typing import Any, Mapping, Sequence

from gem_core.capabilities import TIME_WINDOWS
from gem_core.config import GemConfig
from gem_core.contracts import DataSource, WindowedSource
from gem_core.errors import GemConfigError, GemPluginError
from gem_core.registry import ImplementationSpec
from gem_core.train.optim import lr_schedule

log = logging.getLogger(__name__)

#: Figures of a task's evaluation averaged over windows for the headline.
AVERAGED = ("ne", "auc", "calibration", "log_loss", "positive_rate", "gauc")


def check_time_order(config: GemConfig, spec: ImplementationSpec,
                     source: DataSource) -> WindowedSource:
    """The source, after refusing (naming the key) what ``data.order = "time"`` cannot do."""
    name = spec.name
    if TIME_WINDOWS not in spec.capabilities:
        with_it = "parquet" if name != "parquet" else "a source that declares it"
        raise GemConfigError(
            f"data.order = 'time' needs a data source with time windows (capability "
            f"{TIME_WINDOWS!r}); data source {name!r} has none. Use {with_it} on a data set "
            "written with `gem data import --window` / `--append` or `gem data synth --windows`")
    if not isinstance(source, WindowedSource):
        raise GemPluginError(
            f"data source {name!r} (plugin {spec.plugin or '?'}) declares {TIME_WINDOWS!r} but "
            f"built a {type(source).__name__}, which is not a gem_core.contracts.WindowedSource")
    train = config.train
    refused = [
        (lr_schedule(config) == "cosine",
         "train.lr_schedule = 'cosine' decays towards train.steps, and a stream that gains "
         "windows has no last step: use 'constant' (or 'auto')"),
        (train.early_stopping_patience > 0,
         "train.early_stopping_patience: each window is new data, so a rising NE is not "
         "overfitting; set it to 0"),
        (train.epochs > 1,
         f"train.epochs = {train.epochs}: time order is one pass over the windows; set it to 1 "
         "(the default) or 0"),
        (train.validation_share > 0,
         f"train.validation_share = {train.validation_share}: each evaluation is of another "
         "window and no checkpoint is ranked, so there is nothing to choose on a validation "
         "part; set it to 0"),
    ]
    for bad, why in refused:
        if bad:
            raise GemConfigError(f"data.order = 'time' cannot be combined with {why}")
    if not source.windows():
        raise GemConfigError(f"data.order = 'time': data source {name!r} has no time windows")
    return source


class TimeOrder:
    """Where the stream is among the windows, which window is due for evaluation, and the
    summary of the evaluations."""

    def __init__(self, source: WindowedSource, tasks: Sequence[str]) -> None:
        self.source, self.tasks = source, tuple(tasks)
        self.windows = list(source.windows())

    def position(self, data_position: Mapping[str, Any]) -> tuple[int, bool]:
        """(index of the window the next batch comes from, whether it has been begun)."""
        return self.source.window_at(data_position)

    def ended(self, data_position: Mapping[str, Any]) -> bool:
        """Every window has been trained on."""
        return self.position(data_position)[0] >= len(self.windows)

    def at_window_start(self, data_position: Mapping[str, Any]) -> bool:
        """The last trained batch ended a window (or none has been trained)."""
        return not self.position(data_position)[1]

    def due(self, data_position: Mapping[str, Any],
            history: Sequence[Mapping[str, Any]]) -> int | None:
        """The window to evaluate now: the next one, when it has not been begun, is not the
        first (an untrained model's figures say nothing) and has no evaluation yet."""
        index, begun = self.position(data_position)
        if begun or index == 0 or index >= len(self.windows):
            return None
        name = self.windows[index].name
        if any(entry.get("window") == name for entry in history):
            return None
        return index

    def describe(self, index: int) -> dict[str, Any]:
        """The fields an evaluation of window ``index`` carries in ``eval.jsonl``."""
        window = self.windows[index]
        return {"window": window.name, "window_index": index, "window_rows": window.rows,
                "window_first_time": window.first_time, "window_last_time": window.last_time}

    def planned_steps(self, batch_size: int, token_budget: bool) -> int | None:
        """Steps of one pass over every window with ``batch_size`` requests per batch (each
        window ends with a batch of its own); None when batches are cut by a token budget."""
        if token_budget:
            return None
        return sum(math.ceil(w.rows / batch_size) for w in self.windows)

    def ending(self, step: int) -> dict[str, str]:
        """Why the run ends: the windows ran out."""
        last = self.windows[-1]
        return {"reason": "windows",
                "message": f"trained on every window ({len(self.windows)}, the last "
                           f"{last.name!r}) by step {step}; when the data set gains windows "
                           "(gem data import --append), run gem train with the same --out to "
                           "continue"}

    def summary(self, history: Sequence[Mapping[str, Any]], trained: int) -> dict[str, Any]:
        """``summary.json``'s ``progressive``: each window's evaluation and their mean per
        task; ``trained``: windows trained on."""
        entries = [e for e in history if "window" in e]
        windows = [{key: entry[key] for key in ("window", "window_index", "step",
                                                 "window_rows", *self.tasks)}
                   for entry in entries]
        return {"windows": windows, "windows_trained": trained,
                "windows_total": len(self.windows), "mean": self.mean(entries)}

    def mean(self, entries: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
        """Per task, each averaged figure's mean over the windows' evaluations (None where a
        window's is undefined, or there is no evaluation yet), the impressions summed and the
        number of windows."""
        out: dict[str, dict[str, Any]] = {}
        for task in self.tasks:
            reports = [entry[task] for entry in entries]
            figures: dict[str, Any] = {}
            for key in AVERAGED:
                values = [r.get(key) for r in reports if key in r]
                finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
                figures[key] = (statistics.fmean(finite)
                                if values and len(finite) == len(values) else None)
            if not any(r.get("gauc_users") for r in reports):
                figures.pop("gauc")
            else:
                figures["gauc_users"] = sum(r.get("gauc_users", 0) for r in reports)
            figures["samples"] = sum(r.get("samples", 0) for r in reports)
            figures["windows"] = len(reports)
            out[task] = figures
        return out

    def log_plan(self, start_index: int, steps_cap: int, planned: int | None) -> None:
        """One line at start-up: the windows ahead and when the run ends."""
        names = [w.name for w in self.windows]
        ahead = names[start_index:]
        if not ahead:
            log.info("time order: all %d windows are trained on already (the last %r); append "
                     "a window to continue", len(names), names[-1])
            return
        log.info("time order: %d windows, training on %d (%s ... %s), evaluating each before "
                 "training on it", len(names), len(ahead), ahead[0], ahead[-1])
        if planned is not None and planned > steps_cap:
            log.warning("train.steps = %d ends this run before the last window (one pass over "
                        "the windows is %d steps): raise train.steps to train on every window",
                        steps_cap, planned)
