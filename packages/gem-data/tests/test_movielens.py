"""MovieLens-100k: the adapter on GroupLens/atomic fixtures written here; the real fetch (slow)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from gem_core.config import DataConfig
from gem_core.data.api import contiguous_balancer
from gem_core.errors import GemDataError
from gem_data.movielens import build_impressions, read_movielens
from gem_data.testing import GENRES, write_movielens_sample


@pytest.fixture
def grouplens(tmp_path):
    d = tmp_path / "ml-100k"
    return d, write_movielens_sample(d)


@pytest.fixture
def atomic(tmp_path, grouplens):
    source, rows = grouplens
    d = tmp_path / "atomic"
    d.mkdir()
    (d / "ml-100k.inter").write_text("user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
                                     + "".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in rows))
    users = [line.split("|") for line in (source / "u.user").read_text().splitlines()]
    (d / "ml-100k.user").write_text(
        "user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n"
        + "".join("\t".join(u) + "\n" for u in users))
    items = []
    for line in (source / "u.item").read_text(encoding="latin-1").splitlines():
        parts = line.split("|")
        genres = " ".join(GENRES[k] for k, f in enumerate(parts[5:]) if f == "1")
        items.append(f"{parts[0]}\t{parts[1]}\t{parts[2][-4:]}\t{genres}\n")
    (d / "ml-100k.item").write_text("item_id:token\tmovie_title:token_seq\trelease_year:token\t"
                                    "class:token_seq\n" + "".join(items))
    return d, rows


def _by_user(rows):
    by_user = {}
    for u, i, r, t in sorted(rows, key=lambda x: (x[0], x[3], x[1])):
        by_user.setdefault(u, []).append((i, r, t))
    return by_user


def _check_requests(schema, splits, rows, window_s, max_history):
    by_user = _by_user(rows)
    train, evaluation = splits["train"], splits["eval"]
    assert train.num_candidates + evaluation.num_candidates == len(rows)
    # Time split: every training request is earlier than every held-out one.
    assert int(train.request_timestamps.max()) < int(evaluation.request_timestamps.min())
    seen = set()
    for batch in (train, evaluation):
        batch.validate(schema)
        for row in range(batch.batch_size):
            user = int(batch.sparse["user_id"].values[row])
            assert int(batch.user_ids[row]) == user
            when = int(batch.request_timestamps[row])
            events = by_user[user]
            cs, ce = int(batch.candidate_offsets[row]), int(batch.candidate_offsets[row + 1])
            movies = batch.candidate_ids["movie"][cs:ce].tolist()
            expected = [e for e in events if when <= e[2] <= when + window_s
                        and (e[0], user) not in seen]
            assert movies == [e[0] for e in expected][:len(movies)]
            seen.update((m, user) for m in movies)
            assert batch.labels["like"][cs:ce].tolist() == [
                float(e[1] >= 4) for e in expected[:len(movies)]]
            # History: the user's ratings strictly before the request, most recent kept.
            history = [e for e in events if e[2] < when][-max_history:]
            s, e = int(batch.seq_offsets[row]), int(batch.seq_offsets[row + 1])
            assert batch.event_ids["movie"][s:e].tolist() == [h[0] for h in history]
            assert batch.event_ids["rating"][s:e].tolist() == [h[1] - 1 for h in history]
            assert bool((batch.seq_timestamps[s:e] < when).all())
            genres = batch.event_ids["genres"]
            for k, h in enumerate(history):
                got = genres.values[genres.offsets[s + k]:genres.offsets[s + k + 1]].tolist()
                assert got == sorted({h[0] % 19} | ({(h[0] + 5) % 19} if h[0] % 4 == 0
                                                    else set()))
    assert len(seen) == len(rows)


def test_requests_follow_the_definition(grouplens):
    directory, rows = grouplens
    raw = read_movielens(directory)
    schema, splits = build_impressions(raw, max_history=8, eval_fraction=0.2)
    _check_requests(schema, splits, rows, window_s=0, max_history=8)
    assert schema.tasks == ("like",) and schema.table("movie").num_embeddings == 31
    # Ties in the fixture: some requests hold several candidates.
    counts = splits["train"].candidate_counts()
    assert int(counts.max()) >= 2 and int(counts.min()) == 1
    decade = splits["train"].candidate_ids["decade"]
    assert int(decade.min()) >= 0 and int(decade.max()) < 11


def test_request_window_groups_nearby_ratings(grouplens):
    directory, rows = grouplens
    raw = read_movielens(directory)
    window = 2_000_000
    schema, splits = build_impressions(raw, max_history=8, eval_fraction=0.2, window_s=window)
    single = build_impressions(raw, max_history=8, eval_fraction=0.2)[1]
    assert (splits["train"].batch_size + splits["eval"].batch_size
            < single["train"].batch_size + single["eval"].batch_size)
    for batch in splits.values():
        batch.validate(schema)
        # Every candidate is rated at or after its request's time (history strictly before).
        owner = batch.candidate_rows()
        assert bool((batch.seq_timestamps < batch.request_timestamps[
            torch.repeat_interleave(torch.arange(batch.batch_size), batch.seq_lengths())]).all())
        assert owner.numel() == batch.num_candidates


def test_grouplens_and_atomic_files_agree(grouplens, atomic):
    a = build_impressions(read_movielens(grouplens[0]), max_history=8, eval_fraction=0.2)[1]
    b = build_impressions(read_movielens(atomic[0]), max_history=8, eval_fraction=0.2)[1]
    for split in ("train", "eval"):
        assert torch.equal(a[split].event_ids["movie"], b[split].event_ids["movie"])
        assert torch.equal(a[split].candidate_ids["decade"], b[split].candidate_ids["decade"])
        assert torch.equal(a[split].candidate_offsets, b[split].candidate_offsets)
        assert torch.equal(a[split].candidate_ids["genres"].offsets,
                           b[split].candidate_ids["genres"].offsets)


def test_movielens_source_trains_from_a_path(grouplens, tmp_path):
    from gem_core.plugins import build_plugins

    directory, rows = grouplens
    config = DataConfig(source="movielens-100k", path=str(directory), max_seq_len=16,
                        eval_rows=1000, options={"cache_dir": str(tmp_path / "cache"),
                                                 "eval_fraction": 0.2})
    source = build_plugins().data_source(config, seed=0)
    stream = source.train_stream(batch_size=32, rank=0, world_size=1,
                                 balancer=contiguous_balancer,
                                 cost_fn=lambda b: [1.0] * b.batch_size)
    batch = next(stream)
    batch.validate(source.schema)
    assert batch.batch_size == 32
    held_out = sum(b.batch_size for b in source.eval_batches(batch_size=50))
    assert held_out == source.manifest.rows("eval") and held_out > 0
    # A second source reuses the conversion.
    again = build_plugins().data_source(config, seed=0)
    assert again.directory == source.directory
    assert source.report()["source"] == "movielens-100k"


def test_missing_files_are_reported(tmp_path):
    from gem_core.plugins import build_plugins

    with pytest.raises(GemDataError, match="no MovieLens-100k files"):
        read_movielens(tmp_path)
    config = DataConfig(source="movielens-100k",
                        options={"cache_dir": str(tmp_path / "c"), "download": False})
    with pytest.raises(GemDataError, match="no MovieLens-100k files"):
        build_plugins().data_source(config, seed=0)


def _pip_can_download() -> bool:
    try:
        done = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@pytest.mark.slow
def test_fetch_real_movielens(tmp_path):
    if not _pip_can_download():
        pytest.skip("pip is not available to download the recbole wheel")
    from click.testing import CliRunner

    from gem_data.cli import data_group

    out = tmp_path / "ml"
    result = CliRunner().invoke(data_group, ["fetch", "movielens-100k", "--cache-dir",
                                             str(tmp_path / "cache"), "--out", str(out)])
    if result.exit_code != 0 and "could not download" in result.output:
        pytest.skip(f"pip could not download recbole==1.2.1: {result.output[-300:]}")
    assert result.exit_code == 0, result.output
    assert "train +" in result.output
    from gem_data.manifest import read_manifest

    manifest = read_manifest(out)
    assert manifest.rows("train") + manifest.rows("eval") > 40_000  # requests of 100k ratings
    assert manifest.schema.table("movie").num_embeddings == 1683
    assert manifest.schema.table("user_id").num_embeddings == 944
    result = CliRunner().invoke(data_group, ["validate", str(out)])
    assert result.exit_code == 0, result.output
    shutil.rmtree(tmp_path / "cache")
