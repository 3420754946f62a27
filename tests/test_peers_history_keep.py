"""``tools/peers_recbole.py --history-keep``: DIN's and DIEN's history cut to the events of
given actions, checked against the trainer's own batches (no RecBole needed here)."""

from __future__ import annotations

import numpy as np
import pytest

from gem_core.config import DataConfig
from gem_core.data.api import contiguous_balancer
from gem_core.plugins import build_plugins
from gem_data.peer_export import export_peer_dataset, read_atomic

STEPS, BATCH, EVAL_ROWS, SEQ = 2, 16, 8, 48


@pytest.fixture(scope="module")
def runner(tools):
    """``tools/peers_recbole.py`` (it imports RecBole only inside ``main``)."""
    return tools("peers_recbole")


def test_engaged_history_is_the_trainers_engaged_events(tmp_path, runner):
    data = DataConfig(source="synthetic-ads", max_seq_len=SEQ, eval_rows=EVAL_ROWS,
                      options={"planted": "rare_action"})
    manifest = export_peer_dataset(tmp_path / "peers", data=data, seed=5, steps=STEPS,
                                   batch_size=BATCH)
    field, raw_ids = runner.parse_history_keep("action=1,2", manifest["columns"])
    assert (field, raw_ids) == ("action_list", ["1", "2"])

    header, rows = read_atomic(tmp_path / "peers" / "peers.train.inter")
    names = [h.split(":")[0] for h in header]
    histories = [np.array(row[names.index("item_id_list")].split(), dtype=np.int64)
                 for row in rows]
    actions = [np.array(row[names.index(field)].split(), dtype=np.int64) for row in rows]
    kept, kept_events, events = runner.keep_history_events(histories, actions, {1, 2})

    # What the trainer calls engaged: action != 0, in the batches the export was made of.
    source = build_plugins().data_source(data, seed=5)
    stream = source.train_stream(batch_size=BATCH, rank=0, world_size=1,
                                 balancer=contiguous_balancer,
                                 cost_fn=lambda b: [1.0] * b.batch_size)
    expected = []
    for batch in (next(stream) for _ in range(STEPS)):
        for r in range(batch.batch_size):
            s, e = int(batch.seq_offsets[r]), int(batch.seq_offsets[r + 1])
            start = max(s, e - SEQ)
            ads = batch.event_ids["ad_id"][start:e].numpy()
            engaged = batch.event_ids["action"][start:e].numpy() != 0
            candidates = int(batch.candidate_offsets[r + 1] - batch.candidate_offsets[r])
            expected += [ads[engaged]] * candidates
    assert len(kept) == len(expected) == manifest["train_impressions"]
    for got, want in zip(kept, expected):
        assert np.array_equal(got, want)  # same events, same order
    assert kept_events == sum(k.size for k in expected)
    assert events == sum(h.size for h in histories)
    # rare_action: engaged events are few among many views, and some requests keep some
    assert 0 < kept_events < events / 5


def test_history_keep_refuses_what_it_cannot_do(runner):
    columns = ["user_id:token", "item_id:token", "item_id_list:token_seq",
               "rating_list:token_seq", "genres_list:token_seq", "like:float"]
    assert runner.parse_history_keep("rating=3, 4", columns) == ("rating_list", ["3", "4"])
    with pytest.raises(ValueError, match="no 'action_list' column; its event features: "
                                         "genres, rating"):
        runner.parse_history_keep("action=1", columns)
    for bad in ("rating", "rating=", "=3"):
        with pytest.raises(ValueError, match="expected FEATURE=ID"):
            runner.parse_history_keep(bad, columns)
    with pytest.raises(ValueError, match="impression 1: 3 history events but 2 values"):
        runner.keep_history_events([np.array([7, 8]), np.array([1, 2, 3])],
                                   [np.array([0, 1]), np.array([1, 1])], {1})
