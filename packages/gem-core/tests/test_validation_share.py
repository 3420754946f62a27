"""``train.validation_share``: the eval split divided by a hash of each impression's user into a
validation part, which ranks checkpoints, and the rest, which evaluations report. Checked
against metrics computed in float64 over parts divided by hand, with and without user ids."""

from __future__ import annotations

import attrs
import pytest
import torch

from gem_core.config import DataConfig
from gem_core.data.synthetic import SyntheticOptions, SyntheticSource
from gem_core.distributed import ParallelContext
from gem_core.errors import GemConfigError
from gem_core.metrics import task_report
from gem_core.train.evaluate import (
    VALIDATION,
    check_validation_parts,
    evaluate,
    in_validation,
    selection_ne,
)

TASKS = ("click", "conversion")


class _Precision:
    """No autocast: the reports are compared with float64 ones."""

    def autocast(self, device_type: str):
        return torch.autocast(device_type, enabled=False)


class _ScoringEngine:
    """A stand-in model whose logits are a fixed function of the batch (not of the labels), so
    that each part's metrics can be recomputed by hand (float32, as the evaluation keeps
    them)."""

    def predict(self, batch):
        candidates = batch.candidate_ids["item"].to(torch.float64)
        rows = batch.candidate_rows()
        users = batch.user_ids[rows].to(torch.float64) if batch.user_ids is not None else rows
        return {"click": torch.sin(candidates * 0.37 + users * 0.11).float(),
                "conversion": torch.cos(candidates * 0.23 - users * 0.05).float()}


def _batches(users: bool = True, rows: int = 600):
    source = SyntheticSource(DataConfig(max_seq_len=16, eval_rows=rows), seed=3,
                             options=SyntheticOptions(num_users=150, num_items=400,
                                                      candidates_per_request=2))
    batches = list(source.eval_batches(batch_size=128))
    if not users:
        batches = [attrs.evolve(b, user_ids=None) for b in batches]
    return batches


def _by_hand(batches, share: float):
    """Per task, the float64 reports of the validation part and of the rest, divided by the
    user of each impression (by the request where there are no users)."""
    engine = _ScoringEngine()
    logits, labels, users, keys = {t: [] for t in TASKS}, {t: [] for t in TASKS}, [], []
    for index, batch in enumerate(batches):
        out = engine.predict(batch)
        rows = batch.candidate_rows()
        for task in TASKS:
            logits[task].append(out[task])
            labels[task].append(batch.labels[task])
        if batch.user_ids is not None:
            users.append(batch.user_ids[rows])
            keys.append(batch.user_ids[rows])
        else:
            keys.append(index * 2**32 + rows)
    held = in_validation(torch.cat(keys), share)
    groups = torch.cat(users) if users else None
    parts = {}
    for name, keep in (("validation", held), ("reported", ~held)):
        parts[name] = {t: task_report(torch.cat(logits[t])[keep].double(),
                                      torch.cat(labels[t])[keep].double(),
                                      groups[keep] if groups is not None else None)
                       for t in TASKS}
    return parts, held


@pytest.mark.parametrize("users", [True, False])
def test_each_part_is_reported_as_metrics_over_its_impressions(users):
    batches = _batches(users)
    report = evaluate(_ScoringEngine(), batches, TASKS, ParallelContext(),
                      precision=_Precision(), validation_share=0.4)
    expected, held = _by_hand(batches, 0.4)
    assert 0 < int(held.sum()) < held.numel()
    for task in TASKS:
        for got, want in ((report[task], expected["reported"][task]),
                          (report[VALIDATION][task], expected["validation"][task])):
            assert got["samples"] == want["samples"]
            for figure in ("ne", "auc", "log_loss"):
                assert got[figure] == pytest.approx(want[figure], rel=1e-6, abs=1e-9)
            if users:
                assert got["gauc"] == pytest.approx(want["gauc"], rel=1e-6)
        assert (report[task]["samples"] + report[VALIDATION][task]["samples"]
                == held.numel())
    # Checkpoints are ranked by the validation part; without it, by what is reported.
    assert selection_ne(report, TASKS) == pytest.approx(
        sum(expected["validation"][t]["ne"] for t in TASKS) / 2)
    whole = evaluate(_ScoringEngine(), batches, TASKS, ParallelContext(),
                     precision=_Precision())
    assert VALIDATION not in whole
    assert selection_ne(whole, TASKS) == pytest.approx(
        sum(whole[t]["ne"] for t in TASKS) / 2)


def test_a_users_impressions_stay_on_one_side_and_the_share_is_kept():
    users = torch.arange(-5000, 5000, dtype=torch.int64) * 7919 + 2**40
    held = in_validation(users, 0.25)
    assert abs(held.double().mean().item() - 0.25) < 0.02
    again = in_validation(users.flip(0), 0.25).flip(0)  # a pure function of each key
    assert torch.equal(held, again)
    assert not in_validation(users, 0.0).any()


def test_a_share_that_leaves_a_part_empty_is_refused_before_training():
    batches = _batches(rows=4)
    with pytest.raises(GemConfigError, match="leaves the validation part of the eval split "
                                             "empty.*data.eval_rows"):
        check_validation_parts(batches, 1e-6)
    said = check_validation_parts(_batches(), 0.5)
    assert "checkpoints are ranked on" in said and "hash of their users" in said
    with pytest.raises(GemConfigError, match="leaves the validation part of the eval split"):
        evaluate(_ScoringEngine(), batches, TASKS, ParallelContext(), precision=_Precision(),
                 validation_share=1e-6)
