"""MovieLens-100k: the adapter on GroupLens/atomic fixtures written here; the real fetch (slow)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from gem_core.config import DataConfig
from gem_core.data.api import contiguous_balancer
from gem_core.errors import GemDataError
from gem_data.movielens import build_impressions, read_movielens
from gem_data.movielens_source import movielens_factory

GENRES = ["unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime",
          "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery",
          "Romance", "Sci-Fi", "Thriller", "War", "Western"]
OCCUPATIONS = ["student", "engineer", "writer", "other"]


def ratings(seed=0, users=12, items=30, per_user=(3, 25)):
    rng = np.random.default_rng(seed)
    rows = []
    for user in range(1, users + 1):
        count = int(rng.integers(*per_user))
        movies = rng.choice(np.arange(1, items + 1), size=count, replace=False)
        times = 880_000_000 + np.sort(rng.integers(0, 10_000_000, count))
        times[1:3] = times[1]  # a tie: ordered by movie id
        for movie, t in zip(movies, times):
            rows.append((user, int(movie), int(rng.integers(1, 6)), int(t)))
    return rows


@pytest.fixture
def grouplens(tmp_path):
    d = tmp_path / "ml-100k"
    d.mkdir()
    rows = ratings()
    (d / "u.data").write_text("".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in rows))
    (d / "u.user").write_text("".join(
        f"{u}|{18 + 3 * u}|{'F' if u % 3 == 0 else 'M'}|{OCCUPATIONS[u % 4]}|0{u:04d}\n"
        for u in range(1, 13)))
    items = []
    for i in range(1, 31):
        flags = ["0"] * 19
        flags[i % 19] = "1"
        if i % 4 == 0:
            flags[(i + 5) % 19] = "1"
        date = "" if i == 7 else f"01-Jan-{1950 + i}"
        items.append(f"{i}|Movie {i} (x)|{date}||http://x/{i}|" + "|".join(flags) + "\n")
    (d / "u.item").write_text("".join(items), encoding="latin-1")
    (d / "u.genre").write_text("".join(f"{g}|{k}\n" for k, g in enumerate(GENRES)))
    return d, rows


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


def test_impressions_follow_the_definition(grouplens):
    directory, rows = grouplens
    raw = read_movielens(directory)
    schema, splits = build_impressions(raw, max_history=8, eval_fraction=0.2)
    train, evaluation = splits["train"], splits["eval"]
    assert train.batch_size + evaluation.batch_size == len(rows)
    # Time split: every training impression is earlier than every held-out one.
    assert int(train.request_timestamps.max()) < int(evaluation.request_timestamps.min())
    by_user = {}
    for u, i, r, t in sorted(rows, key=lambda x: (x[0], x[3], x[1])):
        by_user.setdefault(u, []).append((i, r, t))
    for batch in (train, evaluation):
        batch.validate(schema)
        for row in range(batch.batch_size):
            user = int(batch.sparse["user_id"].values[row])
            item = int(batch.candidate_item_ids[row])
            events = by_user[user]
            k = next(j for j, e in enumerate(events)
                     if e[0] == item and e[2] == int(batch.request_timestamps[row]))
            history = events[max(0, k - 8):k]
            s, e = int(batch.seq_offsets[row]), int(batch.seq_offsets[row + 1])
            assert batch.seq_item_ids[s:e].tolist() == [h[0] for h in history]
            assert batch.seq_action_ids[s:e].tolist() == [h[1] - 1 for h in history]
            assert bool((batch.seq_timestamps[s:e] <= batch.request_timestamps[row]).all())
            assert float(batch.labels["like"][row]) == float(events[k][1] >= 4)
    assert schema.tasks == ("like",) and schema.num_items == 31


def test_grouplens_and_atomic_files_agree(grouplens, atomic):
    a = build_impressions(read_movielens(grouplens[0]), max_history=8, eval_fraction=0.2)[1]
    b = build_impressions(read_movielens(atomic[0]), max_history=8, eval_fraction=0.2)[1]
    for split in ("train", "eval"):
        assert torch.equal(a[split].seq_item_ids, b[split].seq_item_ids)
        assert torch.equal(a[split].candidate_sparse["release_decade"],
                           b[split].candidate_sparse["release_decade"])
        assert torch.equal(a[split].sparse["genres"].offsets, b[split].sparse["genres"].offsets)


def test_movielens_source_trains_from_a_path(grouplens, tmp_path):
    directory, rows = grouplens
    config = DataConfig(source="movielens-100k", path=str(directory), max_seq_len=16,
                        eval_rows=1000, options={"cache_dir": str(tmp_path / "cache"),
                                                 "eval_fraction": 0.2})
    source = movielens_factory(config, seed=0)
    stream = source.train_stream(batch_size=32, rank=0, world_size=1,
                                 balancer=contiguous_balancer, cost_fn=lambda b: [1.0] * b.batch_size)
    batch = next(stream)
    batch.validate(source.schema)
    assert batch.batch_size == 32
    held_out = sum(b.batch_size for b in source.eval_batches(batch_size=50))
    assert held_out == source.manifest.rows("eval") and held_out > 0
    # A second source reuses the conversion.
    again = movielens_factory(config, seed=0)
    assert again.directory == source.directory
    assert source.report()["source"] == "movielens-100k"


def test_missing_files_are_reported(tmp_path):
    with pytest.raises(GemDataError, match="no MovieLens-100k files"):
        read_movielens(tmp_path)
    config = DataConfig(source="movielens-100k",
                        options={"cache_dir": str(tmp_path / "c"), "download": False})
    with pytest.raises(GemDataError, match="no MovieLens-100k files"):
        movielens_factory(config, seed=0)


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
    assert "90000 train + 10000 eval" in result.output or "train +" in result.output
    from gem_data.manifest import read_manifest

    manifest = read_manifest(out)
    assert manifest.rows("train") + manifest.rows("eval") == 100_000
    assert manifest.schema.num_items == 1683 and manifest.schema.sparse_features[0].num_embeddings == 944
    result = CliRunner().invoke(data_group, ["validate", str(out)])
    assert result.exit_code == 0, result.output
    shutil.rmtree(tmp_path / "cache")
