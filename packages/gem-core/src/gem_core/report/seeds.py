"""Runs repeated over seeds, compared arm against arm (``gem runs seeds``).

One run per configuration cannot tell two configurations apart when they differ by less than
the spread of the initial draw: on the Taobao-shaped log of docs/results.md one-pass NE moved by
0.005 with ``train.seed`` alone, more than several options' gains. So a comparison is made over
seeds, and paired: the runs are grouped into **arms** (runs whose configurations agree on every
key but the seed keys, ``train.seed`` and ``data.path`` by default: one log per data seed), each
run is identified within its arm by its values of the seed keys, and each arm is compared with
the first over the seeds both ran, seed by seed. A difference between paired runs removes what
the seed does to both (the log, the draw), which a difference of means keeps.

The figures are each task's NE, AUC and GAUC of the run's reported evaluation (``summary.json``'s
``eval``: the chosen checkpoint's where the run chose one), or with ``last`` of its last
evaluation (``eval_last``: the model as training left it, what a peer that chooses no
checkpoint is compared with; a run that chose none reports the same either way).
"""

from __future__ import annotations

import json
import math
from typing import Any, Sequence

import attrs

from gem_core.errors import GemConfigError
from gem_core.report.runs import RunRecord, flatten

DEFAULT_SEED_KEYS = ("train.seed", "data.path")
"""Config keys whose values make the repetitions of one configuration: the initial draw, and
the log where each seed has a data set of its own."""

METRICS = ("ne", "auc", "gauc")
"""The figures compared, per task, from the reported evaluation."""

LOWER_IS_BETTER = {"ne": True, "auc": False, "gauc": False}


@attrs.frozen(kw_only=True)
class Spread:
    """A figure over an arm's seeds (or a difference over paired seeds)."""

    count: int
    mean: float
    sd: float
    """Sample standard deviation (``n - 1``); 0 for a single value."""

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        n = len(values)
        mean = sum(values) / n
        sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
        return cls(count=n, mean=mean, sd=sd)


@attrs.frozen(kw_only=True)
class Arm:
    """Runs of one configuration over seeds."""

    label: str
    """What sets it apart from the first arm (its differing config keys), or ``baseline``."""
    runs: dict[tuple, RunRecord]
    """By the run's values of the seed keys."""
    figures: dict[str, Spread]
    """``task.metric`` over its runs."""
    paired: dict[str, Spread]
    """``task.metric``: this arm's figure minus the first arm's, seed by seed (over the seeds
    both ran); empty for the first arm and for an arm that shares no seed with it."""
    better: dict[str, int]
    """``task.metric``: on how many of the paired seeds this arm is better than the first."""
    unpaired: dict[tuple, RunRecord] = attrs.field(factory=dict)
    """This arm's runs whose seed values the first arm did not run (empty for the first arm):
    they count in :attr:`figures` but not in :attr:`paired`, so a paired "better on 1 of 1"
    over five runs says why here."""
    missing: tuple[tuple, ...] = ()
    """The first arm's seed values this arm did not run (empty for the first arm)."""


def _text(value: Any) -> str:
    """A config value as one comparable text (JSON, keys sorted)."""
    return json.dumps(value, sort_keys=True)


def _figure(run: RunRecord, task: str, metric: str, last: bool = False) -> float | None:
    evaluation = run.summary.get("eval_last") if last else None
    value = (evaluation or run.summary["eval"]).get(task, {}).get(metric)
    return float(value) if isinstance(value, (int, float)) else None


def _config(run: RunRecord) -> dict[str, Any]:
    """The run's configuration as dotted keys, with the keys its version lacked filled as that
    version behaved (a run written before a key was added is not another arm for that alone)."""
    from gem_core.checkpoint.resume import with_defaults

    config = run.summary.get("config")
    return flatten(with_defaults(config)) if isinstance(config, dict) else {}


def seed_arms(runs: Sequence[RunRecord], seed_keys: Sequence[str] = DEFAULT_SEED_KEYS,
              ignored_keys: Sequence[str] = (), *, last: bool = False) -> list[Arm]:
    """Group ``runs`` into arms (in the order each arm's first run comes) and compare each with
    the first, at each run's reported evaluation or (``last``) its last one. ``ignored_keys``
    do not set arms apart (a setting that does not act in these runs, such as how often they
    evaluated). Two runs of one arm with the same seed values are an error naming both (a
    repetition would be counted twice). An arm that shares no seed with the first has its
    figures and no paired difference."""
    if not runs:
        raise GemConfigError("gem runs seeds: no runs given")
    left_out = {*seed_keys, *ignored_keys, "name"}
    groups: dict[tuple, dict[tuple, RunRecord]] = {}
    for run in runs:
        config = _config(run)
        seed = tuple(_text(config.get(key)) for key in seed_keys)
        rest = tuple(sorted((key, _text(value)) for key, value in config.items()
                            if key not in left_out))
        arm = groups.setdefault(rest, {})
        if seed in arm:
            raise GemConfigError(
                f"gem runs seeds: {arm[seed].path} and {run.path} have the same configuration "
                f"and the same seed keys ({', '.join(seed_keys)}): one run would count twice")
        arm[seed] = run
    configs = list(groups)
    first = dict(configs[0])
    tasks = runs[0].tasks
    arms = []
    for index, (rest, members) in enumerate(groups.items()):
        own = dict(rest)
        changed = sorted(key for key in set(own) | set(first) if own.get(key) != first.get(key))
        label = ("baseline" if index == 0 else
                 ", ".join(f"{key}={own.get(key, 'unset')}" for key in changed))
        figures, paired, better = {}, {}, {}
        for task in tasks:
            for metric in METRICS:
                name = f"{task}.{metric}"
                values = [v for v in (_figure(r, task, metric, last)
                                      for r in members.values()) if v is not None]
                if values:
                    figures[name] = Spread.of(values)
                if index == 0:
                    continue
                base = groups[configs[0]]
                pairs = [(_figure(run, task, metric, last), _figure(base[seed], task, metric, last))
                         for seed, run in members.items() if seed in base]
                pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
                if pairs:
                    paired[name] = Spread.of([a - b for a, b in pairs])
                    better[name] = sum((a < b) if LOWER_IS_BETTER[metric] else (a > b)
                                       for a, b in pairs)
        base_seeds = groups[configs[0]]
        unpaired = {} if index == 0 else {
            seed: run for seed, run in members.items() if seed not in base_seeds}
        missing = () if index == 0 else tuple(s for s in base_seeds if s not in members)
        arms.append(Arm(label=label, runs=members, figures=figures, paired=paired,
                        better=better, unpaired=unpaired, missing=missing))
    return arms


def arms_json(arms: Sequence[Arm],
              seed_keys: Sequence[str] = DEFAULT_SEED_KEYS) -> dict[str, Any]:
    """The arms as one JSON object (``gem runs seeds --json``); ``seed_keys`` name the values
    of each missing seed."""
    def spread(s: Spread) -> dict[str, Any]:
        return {"count": s.count, "mean": s.mean, "sd": s.sd}

    return {"arms": [{"label": arm.label, "runs": [str(r.path) for r in arm.runs.values()],
                      "figures": {k: spread(v) for k, v in arm.figures.items()},
                      "paired_difference": {k: spread(v) for k, v in arm.paired.items()},
                      "better_on": arm.better,
                      "unpaired_runs": [str(r.path) for r in arm.unpaired.values()],
                      "missing_seeds": [dict(zip(seed_keys, map(json.loads, seed)))
                                        for seed in arm.missing]} for arm in arms]}
