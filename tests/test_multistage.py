"""Multi-stage training: the upstream tower's embeddings exported to a data set and a ranker on
them. With the same weights and no staleness, the cached path equals the live path exactly."""

from __future__ import annotations

import json

import attrs
import numpy as np
import pyarrow as pa
import pytest
import torch

from gem_core.config import load_config
from gem_core.errors import GemDataError
from gem_core.plugins import build_plugins

pytest.importorskip("pyarrow")

MODEL = ("model.downstream_history=events", "model.pma_queries=2")
SMALL = ("train.steps=4", "train.batch_size=64", "train.eval_every=0", "data.eval_rows=256",
         "data.max_seq_len=32", "data.options.num_items=300")


def _sets(*pairs):
    return [x for pair in pairs for x in ("--set", pair)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, gem):
    run = tmp_path_factory.mktemp("multistage") / "run"
    done = gem("train", "--out", str(run), "--no-progress", *_sets(*MODEL, *SMALL))
    assert done.returncode == 0, done.stderr[-3000:]
    return run


def test_cached_path_equals_live_path(trained, tmp_path):
    from gem_core.serving.programs import ranker_model
    from gem_data.export_user_embeddings import export, load_trained_model

    out = tmp_path / "exported"
    summary = export(trained, out, train_rows=64, staleness_s=0, batch_size=100)
    assert summary["rows"] == {"train": 64, "eval": 256}
    assert summary["eval_ne"]["live_upstream"] == summary["eval_ne"]["cached_upstream"]

    config, source, model, attention, _ = load_trained_model(trained)
    cached_config = attrs.evolve(config.data, source="parquet", path=str(out), options={})
    cached = build_plugins().data_source(cached_config, seed=0)
    assert cached.schema.user_embedding_dim == 2 * config.model.embedding_dim
    ranker = ranker_model(model, attention)
    assert ranker.schema == cached.schema
    live_batches = list(source.eval_batches(batch_size=64))
    cached_batches = list(cached.eval_batches(batch_size=64))
    assert len(live_batches) == len(cached_batches) == 4
    with torch.no_grad():
        for live, exported in zip(live_batches, cached_batches):
            want, got = model(live), ranker(exported)
            for task in want:
                assert torch.equal(want[task], got[task]), task


def test_staleness_changes_the_embeddings_and_is_reported(trained, tmp_path):
    from gem_data.export_user_embeddings import export

    fresh = export(trained, tmp_path / "fresh", train_rows=64, staleness_s=0, batch_size=128)
    stale = export(trained, tmp_path / "stale", train_rows=64, staleness_s=3600,
                   batch_size=128)
    assert stale["eval_ne"]["live_upstream"] == fresh["eval_ne"]["live_upstream"]
    assert stale["eval_ne"]["cached_upstream"] != fresh["eval_ne"]["cached_upstream"]
    written = json.loads((tmp_path / "stale" / "export.json").read_text())
    assert written["staleness_s"] == 3600


def test_export_refuses_a_single_stage_run(tmp_path):
    from gem_core.errors import GemConfigError
    from gem_data.export_user_embeddings import load_trained_model

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text('name = "x"\n[model]\npma_queries = 2\n')
    with pytest.raises(GemConfigError, match="downstream_history = 'events'"):
        load_trained_model(run)


def test_cached_ranker_needs_embeddings_in_the_data():
    from gem_core.attention.bucketed import BucketedAttention
    from gem_core.embedding import ReferenceEmbeddingBackend
    from gem_core.model import build_model

    config = load_config(overrides=[*MODEL, "model.user_embeddings=cached", *SMALL])
    source = build_plugins().data_source(config.data, seed=0)
    with pytest.raises(ValueError, match="has 0"):
        build_model(config.model, source.schema, attention=BucketedAttention(),
                    embedding_backend=ReferenceEmbeddingBackend())
    with pytest.raises(ValueError, match="downstream_history = 'events'"):
        load_config(overrides=["model.user_embeddings=cached", "model.pma_queries=2"])


def test_events_before_keeps_each_rows_older_prefix():
    from gem_data.batch_ops import events_before

    source = build_plugins().data_source(load_config(overrides=SMALL).data, seed=0)
    batch = source.generate(32, split=1, index=0)
    rows = torch.repeat_interleave(torch.arange(32), batch.seq_lengths())
    ages = batch.request_timestamps[rows] - batch.seq_timestamps
    staleness = int(ages.median())  # about half of the events are older than this
    cutoff = batch.request_timestamps - staleness
    cut = events_before(batch, cutoff)
    for row in range(batch.batch_size):
        lo, hi = int(batch.seq_offsets[row]), int(batch.seq_offsets[row + 1])
        stamps = batch.seq_timestamps[lo:hi]
        keep = stamps <= cutoff[row]
        c_lo, c_hi = int(cut.seq_offsets[row]), int(cut.seq_offsets[row + 1])
        assert torch.equal(cut.seq_timestamps[c_lo:c_hi], stamps[keep])
        for name, ids in batch.event_ids.items():  # every event feature is cut alike
            assert torch.equal(cut.event_ids[name][c_lo:c_hi], ids[lo:hi][keep]), name
    assert 0 < cut.num_events < batch.num_events


def test_bad_user_embeddings_are_named_or_dropped(tmp_path):
    from gem_data import format as fmt
    from gem_data.arrow_io import batch_to_table
    from gem_data.validation import Location, ValidationPolicy, ValidationReport, validate_table

    source = build_plugins().data_source(load_config(overrides=SMALL).data, seed=0)
    schema = attrs.evolve(source.schema, user_embedding_dim=4)
    batch = source.generate(8, split=1, index=0)
    embedding = torch.randn(8, 4)
    embedding[5, 2] = float("nan")
    table = batch_to_table(attrs.evolve(batch, user_embedding=embedding), schema)
    where = Location(file="exported/eval-00000.parquet", row_group=0, first_row=0)
    with pytest.raises(GemDataError, match=r"row 5.*'user_embedding' value nan is not finite"):
        validate_table(table, schema, ValidationPolicy(), where)
    report = ValidationReport()
    kept = validate_table(table, schema, ValidationPolicy(dense="drop"), where, report)
    assert kept.num_rows == 7 and report.to_dict()["rows_dropped"]["dense"] == 1
    values = np.asarray(kept.column(fmt.USER_EMBEDDING).combine_chunks().flatten())
    assert np.isfinite(values).all() and isinstance(kept, pa.Table)
