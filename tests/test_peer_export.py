"""``gem_data.peer_export``: the RecBole atomic files of ``tools/peers.py`` hold exactly the
impressions the trainer trains and evaluates on (no RecBole needed here); on data whose history
has no item ids, without ``item_id_list``, and DIN and DIEN refused on it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from gem_core.config import DataConfig
from gem_core.data.api import contiguous_balancer
from gem_core.jagged import Jagged
from gem_core.plugins import build_plugins
from gem_core.schema import ContextFeature, EmbeddingTable, FeatureSchema, SequenceFeature
from gem_data.bench import write_requests
from gem_data.generator import AdsLogGenerator, achievable_figures, achievable_ne
from gem_data.peer_export import (
    export_peer_dataset,
    history_has_item_ids,
    item_feature,
    read_atomic,
)
from gem_data.synth_options import SynthOptions

STEPS, BATCH, EVAL_ROWS, SEQ = 3, 16, 24, 64


def _data(options, *, max_seq_len=SEQ):
    """``[data]`` of a synthetic-ads run."""
    return DataConfig(source="synthetic-ads", max_seq_len=max_seq_len, eval_rows=EVAL_ROWS,
                      options=options)


def _source_batches(options, *, seed, max_seq_len=SEQ, steps=STEPS):
    """The trainer's batches: the synthetic-ads source's own training stream and eval split."""
    source = build_plugins().data_source(_data(options, max_seq_len=max_seq_len), seed=seed)
    stream = source.train_stream(batch_size=BATCH, rank=0, world_size=1,
                                 balancer=contiguous_balancer,
                                 cost_fn=lambda b: [1.0] * b.batch_size)
    return source, [next(stream) for _ in range(steps)]


def _ids(ids, index):
    if isinstance(ids, Jagged):
        a, b = int(ids.offsets[index]), int(ids.offsets[index + 1])
        return [str(v) for v in ids.values[a:b].tolist()]
    return [str(int(ids[index]))]


def _history(batch, name, start, end):
    ids = batch.event_ids[name]
    if isinstance(ids, Jagged):
        a, b = int(ids.offsets[start]), int(ids.offsets[end])
        return " ".join(str(v) for v in ids.values[a:b].tolist())
    return " ".join(str(v) for v in ids[start:end].tolist())


def _expected_rows(batch, max_seq_len, *, multi_valued):
    """Each impression's fields, computed here from the batch (not by the exporter)."""
    rows = []
    for r in range(batch.batch_size):
        s, e = int(batch.seq_offsets[r]), int(batch.seq_offsets[r + 1])
        start = max(s, e - max_seq_len)
        times = batch.seq_timestamps[start:e]
        assert bool((times[1:] >= times[:-1]).all()), "history not in time order"
        segment = batch.sparse["user_segment"]
        context = batch.sparse["context"]
        for c in range(int(batch.candidate_offsets[r]), int(batch.candidate_offsets[r + 1])):
            row = {"user_id": str(int(batch.user_ids[r])),
                   "item_id": str(int(batch.candidate_ids["ad_id"][c])),
                   "advertiser": str(int(batch.candidate_ids["advertiser"][c])),
                   "category": str(int(batch.candidate_ids["category"][c])),
                   "user_segment": " ".join(_ids(segment, r)),
                   "context": " ".join(_ids(context, r)),
                   "item_id_list": _history(batch, "ad_id", start, e),
                   "advertiser_list": _history(batch, "advertiser", start, e),
                   "category_list": _history(batch, "category", start, e),
                   "action_list": _history(batch, "action", start, e),
                   "click": float(batch.labels["click"][c]),
                   "conversion": float(batch.labels["conversion"][c]),
                   "dense": [float(v) for v in batch.dense[r].tolist()],
                   "history_length": e - start}
            if multi_valued:
                row["topics"] = " ".join(_ids(batch.candidate_ids["topics"], c))
                row["topics_list"] = _history(batch, "topics", start, e)
            rows.append(row)
    return rows


def _check_rows(path, batches, max_seq_len, *, multi_valued):
    header, rows = read_atomic(path)
    names = [h.split(":")[0] for h in header]
    types = dict(h.split(":") for h in header)
    assert types["item_id"] == "token" and types["item_id_list"] == "token_seq"
    assert types["click"] == "float" and types["dense_0"] == "float"
    expected = [row for batch in batches
                for row in _expected_rows(batch, max_seq_len, multi_valued=multi_valued)]
    assert len(rows) == len(expected) == sum(b.num_candidates for b in batches)
    for got, want in zip(rows, expected):
        got = dict(zip(names, got))
        for key, value in want.items():
            if key == "dense":
                # exact: the float32 value, no rounding
                assert [float(got[f"dense_{j}"]) for j in range(len(value))] == value
            elif key == "history_length":
                assert len(got["item_id_list"].split()) == value <= max_seq_len
            elif key in ("click", "conversion"):
                assert float(got[key]) == value
            else:
                assert got[key] == value, key
    return header, rows


def test_export_is_the_trainers_impressions(tmp_path):
    options = {"planted": "multi_valued"}
    manifest = export_peer_dataset(tmp_path / "peers", data=_data(options), seed=3,
                                   steps=STEPS, batch_size=BATCH)
    source, batches = _source_batches(options, seed=3)
    assert manifest["train_impressions"] == sum(b.num_candidates for b in batches)
    assert manifest["train_requests"] == STEPS * BATCH
    _, train_rows = _check_rows(tmp_path / "peers" / "peers.train.inter", batches, SEQ,
                                multi_valued=True)
    # 64-bit ids, exactly: some beyond float64's exact integers, negative ones too
    ads = [int(row[1]) for row in train_rows]
    assert any(abs(a) > 2**53 for a in ads) and any(a < 0 for a in ads)

    # The eval rows are the split achievable_ne measures: its chunks, in its order.
    generator = source.generator
    chunks = [generator.chunk_with_probabilities(size, split="eval", index=index)[0]
              for index, size in generator.eval_chunks(EVAL_ROWS)]
    _check_rows(tmp_path / "peers" / "peers.test.inter", chunks, SEQ, multi_valued=True)
    keys = np.load(tmp_path / "peers" / "eval_keys.npz")
    users = torch.cat([c.user_ids[c.candidate_rows()] for c in chunks]).numpy()
    assert np.array_equal(keys["user_ids"], users)
    for task in ("click", "conversion"):
        assert np.array_equal(keys[task], torch.cat([c.labels[task] for c in chunks]).numpy())
    assert manifest["eval_impressions"] == keys["click"].size
    assert manifest["achievable_ne"] == pytest.approx(achievable_ne(generator, EVAL_ROWS))
    truth = achievable_figures(generator, EVAL_ROWS)
    for metric in ("auc", "gauc"):
        assert manifest[f"achievable_{metric}"] == pytest.approx(
            {task: figures[metric] for task, figures in truth.items()})

    # RecBole's benchmark mode reads a validation file: the first eval rows, nothing new.
    _, valid = read_atomic(tmp_path / "peers" / "peers.valid.inter")
    _, test = read_atomic(tmp_path / "peers" / "peers.test.inter")
    assert valid == test[:len(valid)]

    # Every ad, with the attributes events and candidates give it.
    item_header, items = read_atomic(tmp_path / "peers" / "peers.item")
    assert item_header == ["item_id:token", "advertiser:token", "category:token",
                           "topics:token_seq"]
    table = {row[0]: row[1:] for row in items}
    assert len(table) == len(items)
    for batch in batches + chunks:
        for store in (batch.candidate_ids, batch.event_ids):
            for i in range(0, store["ad_id"].numel(), 7):
                assert table[str(int(store["ad_id"][i]))] == [
                    str(int(store["advertiser"][i])), str(int(store["category"][i])),
                    " ".join(_ids(store["topics"], i))]
    saved = json.loads((tmp_path / "peers" / "manifest.json").read_text())
    assert saved["options"]["max_length"] == SEQ and saved["data_seed"] == 3


def test_data_seed_train_start_and_history_cut(tmp_path):
    # data_seed replaces train.seed, train_start shifts the training window; a history longer
    # than max_seq_len (max_length set above it) keeps its most recent events.
    options = {"data_seed": 11, "train_start": 5, "max_length": 200, "mean_length": 80.0}
    manifest = export_peer_dataset(tmp_path / "peers", data=_data(options, max_seq_len=8),
                                   seed=0, steps=2, batch_size=BATCH)
    assert manifest["data_seed"] == 11
    _, batches = _source_batches(options, seed=0, max_seq_len=8, steps=2)
    generator = AdsLogGenerator(SynthOptions(**options), seed=11)
    direct = generator.chunk(BATCH, split="train", index=1)  # generator chunk 6
    assert torch.equal(direct.candidate_ids["ad_id"], batches[1].candidate_ids["ad_id"])
    assert int(batches[0].seq_lengths().max()) > 8
    _check_rows(tmp_path / "peers" / "peers.train.inter", batches, 8, multi_valued=False)


# -- a history without item ids (a Taobao-shaped log) --------------------------------------------

#: Taobao-shaped: the candidate is an ad (adgroup_id, its category, the placement), the events
#: are what the behaviour log records (a category and an action), never the ad; the ad has a
#: price (a candidate numeric feature).
NO_ITEM_HISTORY = FeatureSchema(
    tables=(EmbeddingTable(name="adgroup", num_embeddings=500, id_policy="hash"),
            EmbeddingTable(name="cate", num_embeddings=40, id_policy="hash"),
            EmbeddingTable(name="btag", num_embeddings=4),
            EmbeddingTable(name="pid", num_embeddings=2),
            EmbeddingTable(name="gender", num_embeddings=3)),
    event_features=(SequenceFeature(name="cate", table="cate"),
                    SequenceFeature(name="btag", table="btag")),
    candidate_features=(SequenceFeature(name="adgroup_id", table="adgroup"),
                        SequenceFeature(name="cate", table="cate"),
                        SequenceFeature(name="pid", table="pid")),
    sparse_features=(ContextFeature(name="gender", table="gender"),),
    num_dense=1, candidate_numeric_dim=1, tasks=("clk",), max_seq_len=SEQ)
NO_ITEM_COLUMNS = ["user_id:token", "item_id:token", "cate:token", "pid:token",
                   "candidate_numeric_0:float", "gender:token_seq", "dense_0:float",
                   "cate_list:token_seq", "btag_list:token_seq", "clk:float"]


@pytest.fixture(scope="module")
def no_item_history(tmp_path_factory):
    """A parquet data set of :data:`NO_ITEM_HISTORY`: 64 training and 24 eval requests,
    histories longer than 8 events (the cut below) included."""
    out = tmp_path_factory.mktemp("no-item-history") / "data"
    write_requests(out, NO_ITEM_HISTORY, rows=64, eval_rows=24, seed=1, row_group_rows=32,
                   mean_length=12.0, max_length=SEQ)
    return out


def _no_item_data(path, max_seq_len=8):
    return DataConfig(source="parquet", path=str(path), max_seq_len=max_seq_len,
                      eval_rows=None)


def test_a_history_without_item_ids_is_exported_without_item_id_list(no_item_history,
                                                                      tmp_path):
    out = tmp_path / "peers"
    out.mkdir()
    (out / "peers.item").write_text("item_id:token\n1\n")  # an earlier export's
    data = _no_item_data(no_item_history)
    manifest = export_peer_dataset(out, data=data, seed=2, steps=2, batch_size=BATCH)
    assert manifest["history_item_ids"] is False and manifest["item_list_field"] is None
    assert manifest["item_feature"] == "adgroup_id" and manifest["item_field"] == "item_id"
    assert manifest["event_features"] == ["cate", "btag"]
    assert manifest["columns"] == NO_ITEM_COLUMNS and manifest["item_columns"] == []
    assert manifest["candidate_numeric_columns"] == ["candidate_numeric_0"]
    # no .item file: events that do not name their ad give no ad its attributes
    assert not (out / "peers.item").exists()
    assert json.loads((out / "manifest.json").read_text()) == manifest

    # The rows are the trainer's impressions: its stream's batches, histories cut at 8 events.
    source = build_plugins().data_source(data, seed=2)
    stream = source.train_stream(batch_size=BATCH, rank=0, world_size=1,
                                 balancer=contiguous_balancer,
                                 cost_fn=lambda b: [1.0] * b.batch_size)
    batches = [next(stream) for _ in range(2)]
    stream.close()
    header, rows = read_atomic(out / "peers.train.inter")
    assert header == NO_ITEM_COLUMNS
    names = [h.split(":")[0] for h in header]
    expected = []
    for batch in batches:
        for r in range(batch.batch_size):
            s, e = int(batch.seq_offsets[r]), int(batch.seq_offsets[r + 1])
            start = max(s, e - 8)
            for c in range(int(batch.candidate_offsets[r]),
                           int(batch.candidate_offsets[r + 1])):
                expected.append({
                    "user_id": str(int(batch.user_ids[r])),
                    "item_id": str(int(batch.candidate_ids["adgroup_id"][c])),
                    "cate": str(int(batch.candidate_ids["cate"][c])),
                    "pid": str(int(batch.candidate_ids["pid"][c])),
                    "candidate_numeric_0": float(batch.candidate_numeric[c, 0]),
                    "gender": " ".join(_ids(batch.sparse["gender"], r)),
                    "dense_0": float(batch.dense[r, 0]),
                    "cate_list": _history(batch, "cate", start, e),
                    "btag_list": _history(batch, "btag", start, e),
                    "clk": float(batch.labels["clk"][c])})
    assert len(rows) == len(expected) == manifest["train_impressions"]
    assert max(len(row[names.index("btag_list")].split()) for row in rows) == 8
    for got, want in zip(rows, expected):
        got = dict(zip(names, got))
        for key, value in want.items():
            exact = key in ("dense_0", "candidate_numeric_0", "clk")
            assert (float(got[key]) if exact else got[key]) == value, key
    # the items counted are the candidates' (training and eval)
    _, test = read_atomic(out / "peers.test.inter")
    assert manifest["items"] == len({row[1] for row in rows + test})

    assert not history_has_item_ids(NO_ITEM_HISTORY)
    assert item_feature(NO_ITEM_HISTORY).name == "adgroup_id"


def test_din_and_dien_are_refused_on_a_history_without_item_ids(no_item_history, tmp_path,
                                                                tools):
    runner = tools("peers_recbole")
    manifest = export_peer_dataset(tmp_path / "peers", data=_no_item_data(no_item_history),
                                   seed=2, steps=1, batch_size=BATCH)
    for model in ("DIN", "DIEN"):
        reason = runner.model_refusal(manifest, model)
        assert reason is not None and reason.startswith(f"{model} reads the history as item ids")
        assert "item feature 'adgroup_id'" in reason
        assert "the history's event features are cate, btag" in reason
    for model in ("DeepFM", "DCNV2"):
        assert runner.model_refusal(manifest, model) is None
        # with the history as bags: the event features' lists, no item_id_list
        config = runner._config_dict(manifest, tmp_path / "peers", model, "clk", 1, 2020,
                                     tmp_path / "run", history_bags=True)
        assert config["load_col"] == {"inter": [c.split(":")[0] for c in NO_ITEM_COLUMNS]}
        assert config["alias_of_item_id"] is None
        # the price is a numerical feature, read through RecBole's logarithm buckets
        assert config["numerical_features"] == ["dense_0", "candidate_numeric_0"]
        assert config["discretization"] == {"candidate_numeric_0": {"method": "LD"}}
        config = runner._config_dict(manifest, tmp_path / "peers", model, "clk", 1, 2020,
                                     tmp_path / "run")
        assert not any(c.endswith("_list") for c in config["load_col"]["inter"])

    # tools/peers.py refuses them after the export, before any peer trains (no venv needed)
    peers = tools("peers")
    peers.check_models(manifest, ["DeepFM", "DCNV2"], tmp_path / "peers")
    with pytest.raises(SystemExit, match="(?s)DIN reads the history.*DIEN reads the history"):
        peers.check_models(manifest, ["DeepFM", "DIN", "DIEN"], tmp_path / "peers")
    out = tmp_path / "tool"
    with pytest.raises(SystemExit, match="DIN reads the history as item ids"):
        peers.main(["--data", "parquet", "--data-path", str(no_item_history), "--steps", "1",
                    "--batch-size", str(BATCH), "--models", "DeepFM,DIN", "--out", str(out),
                    "--peers-venv", str(tmp_path / "no-venv")])
    assert (out / "peers" / "manifest.json").exists() and not (out / "runs").exists()
    assert not (tmp_path / "no-venv").exists()


def test_din_and_dien_run_on_a_history_with_item_ids(tmp_path, tools):
    runner = tools("peers_recbole")
    manifest = export_peer_dataset(tmp_path / "peers", data=_data({"planted": "ads"}), seed=3,
                                   steps=1, batch_size=BATCH)
    assert manifest["history_item_ids"] is True
    assert manifest["item_list_field"] == "item_id_list"
    assert manifest["event_features"] == ["ad_id", "advertiser", "category", "action"]
    for model in ("DIN", "DIEN", "DeepFM", "DCNV2"):
        assert runner.model_refusal(manifest, model) is None
    # an export from before the field: its history had item ids (others were refused)
    older = {k: v for k, v in manifest.items() if k not in ("history_item_ids",
                                                             "event_features")}
    assert runner.model_refusal(older, "DIN") is None
