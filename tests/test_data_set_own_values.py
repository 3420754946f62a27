"""A data set's own values beat a preset's (issue 28, "logs as they are"): its manifest's
``max_seq_len`` caps the histories unless the user names ``data.max_seq_len`` (``--set`` or their
own config file), evaluation scores the whole eval split unless ``data.eval_rows`` is set, and
the log says which applied and how many requests were scored. The run records the values it
used: its ``config.toml`` and checkpoints, which a resumed run and a reader of the run agree
with."""

from __future__ import annotations

import logging
import tomllib
from pathlib import Path

import pytest

from gem_core.config import DataConfig, load_config
from gem_core.plugins import build_plugins
from gem_core.schema import EmbeddingTable, FeatureSchema, SequenceFeature
from gem_data.bench import write_requests

#: Longer than the ``tiny`` preset's 128.
DATA_SET_MAX_SEQ_LEN = 256
SCHEMA = FeatureSchema(
    tables=(EmbeddingTable(name="item", num_embeddings=200),
            EmbeddingTable(name="action", num_embeddings=3)),
    event_features=(SequenceFeature(name="item", table="item"),
                    SequenceFeature(name="action", table="action")),
    candidate_features=(SequenceFeature(name="item", table="item"),),
    tasks=("click",), max_seq_len=DATA_SET_MAX_SEQ_LEN)


@pytest.fixture(scope="module")
def long_histories(tmp_path_factory) -> Path:
    """64 train and 40 eval requests, histories up to 256 events (many over 128)."""
    out = tmp_path_factory.mktemp("long") / "data"
    write_requests(out, SCHEMA, rows=64, eval_rows=40, seed=1, row_group_rows=32,
                   mean_length=160.0, max_length=DATA_SET_MAX_SEQ_LEN, max_candidates=2)
    return out


@pytest.fixture(scope="module")
def big_eval_split(tmp_path_factory) -> Path:
    """More eval requests (8300) than the old default cap of 8192, with short histories."""
    out = tmp_path_factory.mktemp("big-eval") / "data"
    write_requests(out, SCHEMA, rows=64, eval_rows=8300, seed=2, row_group_rows=4096,
                   mean_length=2.0, max_length=4, max_candidates=1)
    return out


def _parquet(path: Path, *extra: str) -> list[str]:
    return ["data.source=parquet", f"data.path={path}", "data.options={}", *extra]


def _source(config):
    return build_plugins().data_source(config.data, seed=0)


def _longest(source) -> int:
    return max(int(b.seq_lengths().max()) for b in source.eval_batches(batch_size=64))


def test_the_data_sets_max_seq_len_beats_the_presets(long_histories, caplog):
    config = load_config(preset="tiny", overrides=_parquet(long_histories))
    assert config.data.max_seq_len == 128  # the preset's ...
    assert config.data.data_set_wins == ("max_seq_len", "eval_rows")  # ... which gives way
    with caplog.at_level(logging.INFO):
        source = _source(config)
    assert source.schema.max_seq_len == DATA_SET_MAX_SEQ_LEN
    assert _longest(source) > 128  # histories are no longer cut to the preset's 128
    assert ("data.max_seq_len = 256 from the data set's manifest" in caplog.text
            and "128 does not apply; --set data.max_seq_len to choose" in caplog.text)
    applied = source.applied_config(config.data)
    assert (applied.max_seq_len, applied.eval_rows, applied.data_set_wins) == (256, None, ())


def test_max_seq_len_named_by_the_user_applies(long_histories, tmp_path, caplog):
    config = load_config(preset="tiny", overrides=_parquet(long_histories,
                                                           "data.max_seq_len=64"))
    assert config.data.data_set_wins == ("eval_rows",)
    with caplog.at_level(logging.INFO):
        source = _source(config)
    assert source.schema.max_seq_len == 64 and _longest(source) == 64
    assert "data.max_seq_len = 64 as configured (by --set or a config file" in caplog.text
    # A user's own config file names it too; one that does not leaves it to the data set.
    own = tmp_path / "own.toml"
    own.write_text(f'[data]\nsource = "parquet"\npath = "{long_histories}"\nmax_seq_len = 100\n')
    assert _source(load_config(path=own)).schema.max_seq_len == 100
    own.write_text(f'[data]\nsource = "parquet"\npath = "{long_histories}"\n')
    assert _source(load_config(path=own)).schema.max_seq_len == DATA_SET_MAX_SEQ_LEN
    # Longer than the data set's histories: cut to what they hold, and said.
    caplog.clear()
    with caplog.at_level(logging.INFO):
        longer = _source(load_config(overrides=_parquet(long_histories, "data.max_seq_len=999")))
    assert longer.schema.max_seq_len == DATA_SET_MAX_SEQ_LEN
    assert "fewer than the configured 999" in caplog.text


def test_generated_data_keeps_the_presets_values():
    config = load_config(preset="tiny")
    applied = _source(config).applied_config(config.data)
    assert (applied.max_seq_len, applied.eval_rows, applied.data_set_wins) == (128, 8192, ())
    small = load_config(preset="small")
    assert _source(small).applied_config(small.data).eval_rows == 32768


def test_evaluation_covers_the_whole_eval_split_unless_eval_rows_is_set(big_eval_split):
    def scored(data: DataConfig) -> int:
        source = build_plugins().data_source(data, seed=0)
        return sum(b.batch_size for b in source.eval_batches(batch_size=4096))

    whole = DataConfig(source="parquet", path=str(big_eval_split))
    assert whole.eval_rows is None
    assert scored(whole) == 8300
    assert scored(load_config(preset="tiny", overrides=_parquet(big_eval_split)).data) == 8300
    assert scored(DataConfig(source="parquet", path=str(big_eval_split), eval_rows=100)) == 100
    assert scored(load_config(preset="tiny", overrides=_parquet(
        big_eval_split, "data.eval_rows=5000")).data) == 5000
    # Generated data has no end: unset, it generates 8192 requests.
    assert scored(DataConfig(source="synthetic")) == 8192


def test_a_run_records_the_values_it_used(long_histories, tmp_path, caplog):
    from gem_core.train.trainer import train
    from gem_core.trained_run import load_run

    def overrides(*extra: str) -> list[str]:
        return _parquet(long_histories, "train.steps=2", "train.batch_size=16",
                        "train.eval_every=0", "train.checkpoint_every=0",
                        "train.warmup_steps=1", "train.eval_batch_size=64", *extra)

    run = tmp_path / "run"
    with caplog.at_level(logging.INFO):
        train(load_config(preset="tiny", overrides=overrides()), build_plugins(), run,
              progress=False)
    assert "evaluated 40 requests (the whole eval split)" in caplog.text
    recorded = tomllib.loads((run / "config.toml").read_text())["data"]
    assert recorded["max_seq_len"] == DATA_SET_MAX_SEQ_LEN and "eval_rows" not in recorded
    assert recorded["data_set_wins"] == []
    # The same command continues the run: its [data] resolves to what the checkpoint holds.
    caplog.clear()
    with caplog.at_level(logging.INFO):
        train(load_config(preset="tiny", overrides=overrides("train.steps=3")),
              build_plugins(), run, progress=False)
    assert "resumed from" in caplog.text
    # A reader of the run (export, score, distillation's teacher) builds the same model.
    loaded = load_run(run)
    assert loaded.schema.max_seq_len == DATA_SET_MAX_SEQ_LEN
    assert loaded.config.data.max_seq_len == DATA_SET_MAX_SEQ_LEN
    # With a cap, the log says how many of how many.
    caplog.clear()
    with caplog.at_level(logging.INFO):
        train(load_config(preset="tiny", overrides=overrides("data.eval_rows=10")),
              build_plugins(), tmp_path / "capped", progress=False)
    assert "evaluated 10 requests (data.eval_rows = 10 of 40)" in caplog.text
