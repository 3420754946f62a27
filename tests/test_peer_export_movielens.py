"""``gem_data.peer_export`` on ``movielens-100k``: the RecBole files of ``tools/peers.py`` hold
exactly the impressions a MovieLens run trains and evaluates on, and ``tools/peers.py`` refuses
our runs on other data (no RecBole needed here). The data is the small MovieLens directory of
``gem_data.testing`` in GroupLens's formats, as in tests/test_presets_on_sources.py: no
download."""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch

from gem_core.config import DataConfig
from gem_core.data.api import contiguous_balancer
from gem_core.errors import GemDataError
from gem_core.jagged import Jagged
from gem_core.plugins import build_plugins
from gem_data import peer_references
from gem_data.movielens_source import MovieLensOptions
from gem_data.peer_export import (
    export_peer_dataset,
    history_has_item_ids,
    item_feature,
    read_atomic,
)
from gem_data.peer_runs import run_data_differences
from gem_data.testing import write_movielens_sample

STEPS, BATCH, SEQ, SEED = 3, 16, 8, 5
COLUMNS = ["user_id:token", "item_id:token", "genres:token_seq", "decade:token",
           "age_bucket:token_seq", "gender:token_seq", "occupation:token_seq",
           "dense_0:float", "dense_1:float", "item_id_list:token_seq", "rating_list:token_seq",
           "genres_list:token_seq", "decade_list:token_seq", "like:float"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("movielens")
    write_movielens_sample(root / "ml-100k", users=40)  # histories up to 24 ratings
    return root


def _data(root: Path, **changes) -> DataConfig:
    """``[data]`` of a MovieLens run on the sample (its conversion cached under ``root``)."""
    data = DataConfig(source="movielens-100k", path=str(root / "ml-100k"), max_seq_len=SEQ,
                      eval_rows=None, options={"cache_dir": str(root / "cache")})
    return attrs.evolve(data, **changes)


def _train(data: DataConfig, *, steps: int, batch_size: int = BATCH):
    """The trainer's batches: the source's own stream, and the source."""
    source = build_plugins().data_source(data, seed=SEED)
    stream = source.train_stream(batch_size=batch_size, rank=0, world_size=1,
                                 balancer=contiguous_balancer,
                                 cost_fn=lambda b: [1.0] * b.batch_size)
    batches = [next(stream) for _ in range(steps)]
    stream.close()
    return source, batches


def _ids(ids, index) -> str:
    if isinstance(ids, Jagged):
        a, b = int(ids.offsets[index]), int(ids.offsets[index + 1])
        return " ".join(str(v) for v in ids.values[a:b].tolist())
    return str(int(ids[index]))


def _history(batch, name, start, end) -> str:
    ids = batch.event_ids[name]
    if isinstance(ids, Jagged):
        start, end = int(ids.offsets[start]), int(ids.offsets[end])
        ids = ids.values
    return " ".join(str(v) for v in ids[start:end].tolist())


def _expected_rows(batch) -> list[dict]:
    """Each impression's fields, computed here from the batch (not by the exporter)."""
    rows = []
    for r in range(batch.batch_size):
        start, end = int(batch.seq_offsets[r]), int(batch.seq_offsets[r + 1])
        user = str(int(batch.user_ids[r]))
        # MovieLens's context feature user_id is the request's user: one column, user_id.
        assert _ids(batch.sparse["user_id"], r) == user
        for c in range(int(batch.candidate_offsets[r]), int(batch.candidate_offsets[r + 1])):
            rows.append({
                "user_id": user,
                "item_id": _ids(batch.candidate_ids["movie"], c),
                "genres": _ids(batch.candidate_ids["genres"], c),
                "decade": _ids(batch.candidate_ids["decade"], c),
                **{f: _ids(batch.sparse[f], r) for f in ("age_bucket", "gender", "occupation")},
                "item_id_list": _history(batch, "movie", start, end),
                "rating_list": _history(batch, "rating", start, end),
                "genres_list": _history(batch, "genres", start, end),
                "decade_list": _history(batch, "decade", start, end),
                "like": float(batch.labels["like"][c]),
                "dense": [float(v) for v in batch.dense[r].tolist()]})
    return rows


def _check_rows(path: Path, batches) -> list[list[str]]:
    header, rows = read_atomic(path)
    assert header == COLUMNS
    names = [h.split(":")[0] for h in header]
    expected = [row for batch in batches for row in _expected_rows(batch)]
    assert len(rows) == len(expected) == sum(b.num_candidates for b in batches)
    for got, want in zip(rows, expected):
        got = dict(zip(names, got))
        for key, value in want.items():
            if key == "dense":  # exact: the float32 value, no rounding
                assert [float(got["dense_0"]), float(got["dense_1"])] == value
            elif key == "like":
                assert float(got[key]) == value
            else:
                assert got[key] == value, key
    return rows


def test_export_is_a_movielens_runs_impressions(root, tmp_path):
    data = _data(root)
    manifest = export_peer_dataset(tmp_path / "peers", data=data, seed=SEED, steps=STEPS,
                                   batch_size=BATCH)
    source, batches = _train(data, steps=STEPS)
    assert manifest["train_requests"] == STEPS * BATCH and manifest["steps"] == STEPS
    train_rows = _check_rows(tmp_path / "peers" / "peers.train.inter", batches)
    # the histories are cut at max_seq_len (the conversion's cap): some reach it
    assert max(len(row[COLUMNS.index("item_id_list:token_seq")].split())
               for row in train_rows) == SEQ

    # eval_rows unset: the whole eval split, in file order (any batch size gives those rows)
    evals = list(source.eval_batches(batch_size=7))
    assert sum(b.batch_size for b in evals) == source.report()["eval_split_rows"]
    assert manifest["eval_requests"] == source.report()["eval_split_rows"]
    _check_rows(tmp_path / "peers" / "peers.test.inter", evals)
    keys = np.load(tmp_path / "peers" / "eval_keys.npz")
    users = torch.cat([b.user_ids[b.candidate_rows()] for b in evals]).numpy()
    assert np.array_equal(keys["user_ids"], users)
    assert np.array_equal(keys["like"], torch.cat([b.labels["like"] for b in evals]).numpy())
    _, valid = read_atomic(tmp_path / "peers" / "peers.valid.inter")
    _, test = read_atomic(tmp_path / "peers" / "peers.test.inter")
    assert valid == test[:len(valid)]

    # Every movie, with the genres and decade candidates and events give it.
    item_header, items = read_atomic(tmp_path / "peers" / "peers.item")
    assert item_header == ["item_id:token", "genres:token_seq", "decade:token"]
    table = {row[0]: row[1:] for row in items}
    assert len(table) == len(items)
    for batch in batches + evals:
        for store in (batch.candidate_ids, batch.event_ids):
            for i in range(store["movie"].numel()):
                assert table[_ids(store["movie"], i)] == [_ids(store["genres"], i),
                                                          _ids(store["decade"], i)]

    saved = json.loads((tmp_path / "peers" / "manifest.json").read_text())
    assert saved == manifest
    assert manifest["source"] == "movielens-100k" and manifest["tasks"] == ["like"]
    assert manifest["eval_rows"] is None and manifest["max_seq_len"] == SEQ
    assert manifest["item_feature"] == "movie" and manifest["item_field"] == "item_id"
    assert manifest["options"] == attrs.asdict(MovieLensOptions(cache_dir=str(root / "cache")))
    assert "achievable_ne" not in manifest and "data_seed" not in manifest


def test_a_pass_over_the_data_ends_the_export_as_it_ends_a_run(root, tmp_path):
    # train.epochs = 1: the run stops after the step whose batch completes the first pass
    # (that batch runs on into the second), before train.steps.
    data = _data(root)
    manifest = export_peer_dataset(tmp_path / "peers", data=data, seed=SEED, steps=1000,
                                   batch_size=64, epochs=1)
    source, batches = _train(data, steps=manifest["steps"], batch_size=64)
    assert manifest["steps"] == math.ceil(source.report()["train_split_rows"] / 64)
    assert manifest["train_steps"] == 1000 and manifest["train_requests"] == 64 * len(batches)
    _check_rows(tmp_path / "peers" / "peers.train.inter", batches)


def test_the_data_sets_own_max_seq_len_applies_as_in_a_run(root, tmp_path):
    # data_set_wins (a value the user did not choose): the converted data set's cap, which
    # follows data.max_seq_len on MovieLens; the manifest records the value applied.
    data = _data(root, max_seq_len=6, data_set_wins=("max_seq_len",))
    manifest = export_peer_dataset(tmp_path / "peers", data=data, seed=SEED, steps=1,
                                   batch_size=BATCH)
    assert manifest["max_seq_len"] == 6
    assert manifest["data_given"]["data_set_wins"] == ["max_seq_len"]


@pytest.fixture(scope="module")
def peers(tools):
    return tools("peers")


def _summary(manifest: dict, data: DataConfig, **train) -> dict:
    """A run's ``summary.json`` as far as the check reads it: ``[data]`` as the source applied
    it (a run records that), ``[train]`` and the steps it trained."""
    train = {"seed": SEED, "steps": manifest["steps"], "batch_size": manifest["batch_size"],
             "epochs": 1, **train}
    config = {"data": json.loads(json.dumps(attrs.asdict(data))), "train": train}
    return {"config": config, "run": {"steps": train["steps"]}}


def test_our_run_on_other_data_is_refused(root, tmp_path):
    data = _data(root)
    manifest = export_peer_dataset(tmp_path / "peers", data=data, seed=SEED, steps=STEPS,
                                   batch_size=BATCH)
    assert run_data_differences(_summary(manifest, data), manifest) == []
    # how far a stream reads ahead is not data
    same = _data(root, options={**data.options, "prefetch": 0})
    assert run_data_differences(_summary(manifest, same), manifest) == []

    other_source = _summary(manifest, DataConfig(source="synthetic-ads", max_seq_len=SEQ))
    assert run_data_differences(other_source, manifest) == [
        "data.source = 'synthetic-ads' (the export: 'movielens-100k')"]
    differences = run_data_differences(_summary(manifest, _data(root, eval_rows=20)),
                                         manifest)
    assert differences == ["data.eval_rows = 20 (the export: None)"]
    split = _data(root, options={**data.options, "eval_fraction": 0.2})
    assert run_data_differences(_summary(manifest, split), manifest) == [
        "data.options.eval_fraction = 0.2 (the export: 0.1)"]
    differences = run_data_differences(
        _summary(manifest, _data(root, max_seq_len=16), seed=1, steps=STEPS + 1), manifest)
    assert [d.split(" = ")[0] for d in differences] == [
        "data.max_seq_len", "run.steps (steps trained; train.steps", "train.seed"]


def test_our_synthetic_ads_run_on_other_data_is_refused(tmp_path):
    data = DataConfig(source="synthetic-ads", max_seq_len=16, eval_rows=24,
                      options={"planted": "ads"})
    manifest = export_peer_dataset(tmp_path / "peers", data=data, seed=3, steps=2,
                                   batch_size=BATCH)
    assert run_data_differences(_summary(manifest, data, seed=3), manifest) == []
    # train.seed is the data seed unless data.options.data_seed is set
    pinned = attrs.evolve(data, options={"planted": "ads", "data_seed": 3})
    assert run_data_differences(_summary(manifest, pinned, seed=9), manifest) == []
    assert run_data_differences(_summary(manifest, data, seed=9), manifest) == [
        "data seed (data.options.data_seed, else train.seed) = 9 (the export: 3)"]
    other = attrs.evolve(data, eval_rows=8192, options={"planted": "multi_valued"})
    assert run_data_differences(_summary(manifest, other, seed=3), manifest) == [
        "data.eval_rows = 8192 (the export: 24)",
        "data.options.planted = 'multi_valued' (the export: 'ads')"]
    assert run_data_differences(
        _summary(manifest, attrs.evolve(data, source="movielens-100k"), seed=3), manifest) == [
        "data.source = 'movielens-100k' (the export: 'synthetic-ads')"]


def test_the_item_feature_is_the_first_candidate_feature_and_in_the_history(root, tmp_path):
    source = build_plugins().data_source(_data(root), seed=SEED)
    assert item_feature(source.schema).name == "movie"
    assert history_has_item_ids(source.schema)
    without = attrs.evolve(source.schema, event_features=source.schema.event_features[1:])
    assert item_feature(without).name == "movie"
    assert not history_has_item_ids(without)


def test_item_rate_reference_scores_each_item_by_its_training_rate(tmp_path):
    header = "user_id:token\titem_id:token\tgenres:token_seq\tlike:float\n"
    (tmp_path / "peers.train.inter").write_text(
        header + "1\t5\t1 2\t1.0\n2\t5\t\t0.0\n3\t-7\t3\t1.0\n")
    (tmp_path / "peers.test.inter").write_text(
        header + "1\t5\t1 2\t1.0\n1\t-7\t3\t0.0\n2\t9\t\t1.0\n2\t5\t\t0.0\n")
    keys = {"like": np.array([1.0, 0.0, 1.0, 0.0]), "user_ids": np.array([1, 1, 2, 2])}
    got = peer_references.item_rate_reference(tmp_path, "like", keys)
    overall, prior = 2 / 3, peer_references.ITEM_RATE_PRIOR
    item5 = (1 + prior * overall) / (2 + prior)
    item7 = (1 + prior * overall) / (1 + prior)
    # item 9 was never trained on: the overall rate
    expected = peer_references.peer_metrics(np.array([item5, item7, overall, item5]), keys["like"],
                                  keys["user_ids"])
    assert got == expected and got["ne"] > 0
    keys["like"] = np.array([1.0, 1.0, 1.0, 0.0])
    with pytest.raises(GemDataError, match="labels"):
        peer_references.item_rate_reference(tmp_path, "like", keys)


def test_id_offsets_reference_learns_users_and_items_in_one_pass(tmp_path):
    """The user's and the item's offsets, learnt over the training file in its order from the
    log-odds of the training rate, as ``model.id_bias`` steps them at its defaults."""
    from gem_core.config.model_schema import ModelConfig

    header = "user_id:token\titem_id:token\tlike:float\n"
    train = [(1, 5, 1.0), (2, 5, 0.0), (3, -7, 1.0), (1, -7, 1.0), (2, 5, 1.0)]
    (tmp_path / "peers.train.inter").write_text(
        header + "".join(f"{u}\t{i}\t{y}\n" for u, i, y in train))
    (tmp_path / "peers.test.inter").write_text(
        header + "1\t5\t1.0\n1\t-7\t0.0\n2\t9\t1.0\n4\t5\t0.0\n")
    keys = {"like": np.array([1.0, 0.0, 1.0, 0.0]), "user_ids": np.array([1, 1, 2, 4])}
    got = peer_references.id_offsets_reference(tmp_path, "like", keys)
    fields = attrs.fields(ModelConfig)
    rate, fisher = fields.id_bias_rate.default, fields.id_bias_step.default == "fisher"
    base = math.log(0.8 / 0.2)
    user, item, seen = {}, {}, {}
    for u, i, y in train:
        residual = y - 1 / (1 + math.exp(-(base + user.get(u, 0.0) + item.get(i, 0.0))))
        for table, key in ((user, ("u", u)), (item, ("i", i))):
            seen[key] = seen.get(key, 0.0) + residual ** 2
            step = residual / (1 / rate + seen[key]) if fisher else rate * residual
            table[key[1]] = table.get(key[1], 0.0) + step
    logits = [base + user.get(u, 0.0) + item.get(i, 0.0) for u, i in ((1, 5), (1, -7), (2, 9),
                                                                      (4, 5))]
    expected = peer_references.peer_metrics(1 / (1 + np.exp(-np.array(logits))), keys["like"],
                                  keys["user_ids"])
    assert got == pytest.approx(expected, rel=1e-9) and got["ne"] > 0
    assert user[1] != 0 and item[-7] != 0  # the offsets moved
    keys["like"] = np.array([1.0, 1.0, 1.0, 0.0])
    with pytest.raises(GemDataError, match="labels"):
        peer_references.id_offsets_reference(tmp_path, "like", keys)


def test_our_runs_are_read_at_their_last_evaluation(tmp_path, peers):
    # A peer reports its model as its training ended; a run's headline ``eval`` may be an
    # earlier checkpoint picked by its NE on these very impressions, so the table reads
    # ``eval_last``.
    data = DataConfig(source="synthetic-ads", max_seq_len=16, eval_rows=24,
                      options={"planted": "ads"})
    manifest = export_peer_dataset(tmp_path / "peers", data=data, seed=3, steps=2,
                                   batch_size=BATCH)
    samples = manifest["eval_impressions"]
    summary = {**_summary(manifest, data, seed=3),
               "eval": {"click": {"ne": 0.80, "samples": samples}},
               "eval_last": {"click": {"ne": 0.85, "samples": samples}}}
    summary["run"]["name"] = "tiny"
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(summary))
    figures = peers.our_figures(run, manifest, ["click"])
    assert figures["eval"]["click"]["ne"] == 0.85


def test_with_a_validation_part_every_figure_is_of_the_rest(tmp_path, peers):
    # train.validation_share: the run's headline was chosen on a share of the users, so it is
    # what the table reads, and the peers and the reference are scored on the same other users.
    import torch

    from gem_core.train.evaluate import in_validation

    data = DataConfig(source="synthetic-ads", max_seq_len=16, eval_rows=24,
                      options={"planted": "ads"})
    manifest = export_peer_dataset(tmp_path / "peers", data=data, seed=3, steps=2,
                                   batch_size=BATCH)
    users = np.load(tmp_path / "peers" / "eval_keys.npz")["user_ids"]
    keep = peers.reported_part(users, 0.5)
    assert np.array_equal(keep, ~in_validation(torch.from_numpy(users), 0.5).numpy())
    assert 0 < keep.sum() < keep.size
    assert peers.reported_part(users, 0.0).all()
    reported = int(keep.sum())
    summary = {**_summary(manifest, data, seed=3),
               "eval": {"click": {"ne": 0.80, "samples": reported}},
               "eval_last": {"click": {"ne": 0.85, "samples": reported}}}
    summary["config"]["train"]["validation_share"] = 0.5
    summary["run"]["name"] = "tiny"
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(summary))
    figures = peers.our_figures(run, manifest, ["click"], validation_share=0.5,
                                reported=reported)
    assert figures["eval"]["click"]["ne"] == 0.80
    with pytest.raises(SystemExit, match="train.validation_share = 0.5; this table is of "
                                         "--validation-share 0.0"):
        peers.our_figures(run, manifest, ["click"])
    labels = np.arange(users.size) % 2
    probabilities = np.linspace(0.1, 0.9, users.size)
    assert peers.peer_metrics(probabilities, labels, users, keep) == peers.peer_metrics(
        probabilities[keep], labels[keep], users[keep])
