"""The train/eval cut of ``gem data import``: the latest ``eval_fraction`` of the requests by time.

The cut is a time: requests at or after it are eval, all others train, so training never sees a
request later than one it is evaluated on. Requests of one time (a tie) therefore stay on one
side; when the tie straddles the wanted cut, it goes to the side that brings the eval count
closest to the wanted one, so a tie moves at most half of its requests from where an exact
cut would put them (before, the whole tie went to eval: with 80 % of the requests at the last
time, ``eval_fraction = 0.1`` wrote 80 % to eval). What was achieved is reported, not hidden.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np


def wanted_eval(count: int, fraction: float) -> int:
    """Requests an exact cut puts in eval (at least 1 when ``fraction > 0`` and there are two
    requests or more; 0 for ``fraction == 0``)."""
    if fraction <= 0 or count < 2:
        return 0
    return count - min(int(count * (1 - fraction)), count - 1)


def split_time(times: np.ndarray, fraction: float) -> tuple[int | None, dict[str, Any]]:
    """``(cut, summary)``: eval holds the requests at or after ``cut`` (None: no eval split);
    the summary says what was asked, what was achieved and why they differ."""
    ordered = np.sort(times)
    return choose_cut(
        int(times.size), fraction, value_at=lambda i: int(ordered[i]),
        before=lambda t: int(np.searchsorted(ordered, t, side="left")),
        through=lambda t: int(np.searchsorted(ordered, t, side="right")))


def choose_cut(count: int, fraction: float, *, value_at: Callable[[int], int],
               before: Callable[[int], int], through: Callable[[int], int]
               ) -> tuple[int | None, dict[str, Any]]:
    """:func:`split_time` over ``count`` request times known through three questions (an
    engine answers them without holding the times): ``value_at(i)``, the ``i``-th smallest
    time (from 0); ``before(t)`` and ``through(t)``, how many times are ``< t`` and ``<= t``."""
    wanted = wanted_eval(count, fraction)
    summary: dict[str, Any] = {"eval_fraction": fraction, "requests": count,
                               "wanted_eval_requests": wanted}
    cut = None
    if wanted:
        at = value_at(count - wanted)
        first, last = before(at), through(at)  # the tie is [first, last)
        # (distance from the wanted count, -eval count, cut): the tie to eval (unless that
        # leaves no training request) or to train (no eval split if the tie is the latest).
        options = [(abs(count - last - wanted), -(count - last),
                    value_at(last) if last < count else None)]
        if first > 0:
            options.append((abs(count - first - wanted), -(count - first), int(at)))
        cut = min(options, key=lambda option: option[:2])[2]
        if last - first > 1:
            side = "eval" if cut == int(at) else "train"
            summary["tie_at_cut"] = {"time": int(at), "requests": last - first, "side": side}
    achieved = 0 if cut is None else count - before(cut)
    summary.update(eval_requests=achieved,
                   achieved_eval_fraction=round(achieved / count, 6) if count else 0.0,
                   eval_from_time=cut)
    return cut, summary


def describe(summary: dict[str, Any]) -> str:
    """One line for the import's output: the eval share achieved and, if it is not the wanted
    one, why."""
    fraction = summary["eval_fraction"]
    if not fraction:
        return "no eval split (eval_fraction = 0)"
    share = f"{100 * summary['achieved_eval_fraction']:.1f} %"
    line = (f"eval split: {summary['eval_requests']} of {summary['requests']} requests ({share}; "
            f"eval_fraction = {fraction:g} asks for {summary['wanted_eval_requests']})")
    tie = summary.get("tie_at_cut")
    if tie and summary["eval_requests"] != summary["wanted_eval_requests"]:
        line += (f": {tie['requests']} requests share the time {tie['time']} at the cut and stay "
                 f"together in {tie['side']}")
        if not summary["eval_requests"]:
            line += ", so there is no eval split"
    return line
