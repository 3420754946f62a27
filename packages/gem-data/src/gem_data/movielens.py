"""MovieLens-100k as request-level ads-style data, from GroupLens files or RecBole atomic files.

A **request** is a set of ratings one user gave at the same timestamp (or within
``window_s`` seconds of the first of them: :func:`request_groups`). Its candidates are those
rated movies, each labelled ``like = rating >= 4``; its history is the user's ratings strictly
before the request time (ordered by time, ties by movie id; at most ``max_history``, the most
recent). Every history event carries the movie id, the rating as its action (1-5 -> 0-4), the
movie's genres (multi-valued) and its release decade; every candidate the movie, genres and
decade (sharing the event tables, so candidates live in the history's id space). Context
features: user id, age bucket, gender, occupation; two dense features say how long and how
positive the user's past is. The split is by time: requests at or after the ``1 - eval_fraction``
quantile of request times are held out, so no training request comes from the evaluation period.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import numpy as np
import torch

from gem_core.batch import JaggedBatch
from gem_core.errors import GemDataError
from gem_core.jagged import Jagged
from gem_core.schema import ContextFeature, EmbeddingTable, FeatureSchema, SequenceFeature

if TYPE_CHECKING:
    from gem_data.manifest import Manifest

AGE_EDGES = np.array([18, 25, 35, 45, 50, 56])
NUM_DECADES = 11  # 0: unknown year, 1..10: 1920s and earlier .. 2010s
NO_GENRE = "(no genre)"  # the genre of a movie the files give none (every event needs one id)


@attrs.frozen(kw_only=True)
class RawMovieLens:
    """The three tables, with ids as in the files (1-based) and categories coded."""

    user: np.ndarray
    item: np.ndarray
    rating: np.ndarray
    timestamp: np.ndarray
    age: np.ndarray
    """Per user id (index), age in years (0 where unknown)."""
    gender: np.ndarray
    occupation: np.ndarray
    occupations: tuple[str, ...]
    year: np.ndarray
    """Per item id, release year (0 where unknown)."""
    genre_offsets: np.ndarray
    genre_values: np.ndarray
    genres: tuple[str, ...]


def _read_lines(path: Path, encoding: str = "latin-1") -> list[str]:
    if not path.is_file():
        raise GemDataError(f"{path}: MovieLens file is missing")
    return [line for line in path.read_text(encoding=encoding).splitlines() if line.strip()]


def _ratings(path: Path, skip_header: bool) -> np.ndarray:
    try:
        # Atomic files write ratings and times as floats ("3", "881250949.0" both occur).
        table = np.loadtxt(path, delimiter="\t", skiprows=1 if skip_header else 0,
                           dtype=np.float64, ndmin=2).astype(np.int64)
    except (ValueError, OSError) as error:
        raise GemDataError(f"{path}: cannot read ratings ({error})") from None
    if table.shape[1] != 4 or table.shape[0] == 0:
        raise GemDataError(f"{path}: expected rows of user, item, rating, timestamp")
    return table


def read_movielens(directory: str | Path) -> RawMovieLens:
    """Read GroupLens (``u.data``, ``u.user``, ``u.item``) or RecBole atomic
    (``ml-100k.inter``, ``.user``, ``.item``) files from ``directory``."""
    d = Path(directory)
    if (d / "u.data").is_file():
        ratings = _ratings(d / "u.data", skip_header=False)
        users = [line.split("|") for line in _read_lines(d / "u.user")]
        items = [line.split("|") for line in _read_lines(d / "u.item")]
        genre_names = [line.split("|")[0] for line in _read_lines(d / "u.genre")] \
            if (d / "u.genre").is_file() else [f"genre{i}" for i in range(len(items[0]) - 5)]
        years = [_year(row[2][-4:]) for row in items]
        item_genres = [[g for g, flag in enumerate(row[5:]) if flag.strip() == "1"]
                       for row in items]
        item_ids = [int(row[0]) for row in items]
    elif (d / "ml-100k.inter").is_file():
        ratings = _ratings(d / "ml-100k.inter", skip_header=True)
        users = [line.split("\t") for line in _read_lines(d / "ml-100k.user")[1:]]
        items = [line.split("\t") for line in _read_lines(d / "ml-100k.item")[1:]]
        item_ids = [int(row[0]) for row in items]
        years = [_year(row[2]) if len(row) > 2 else 0 for row in items]
        names = [row[3].split() if len(row) > 3 else [] for row in items]
        genre_names = sorted({g for n in names for g in n})
        code = {g: i for i, g in enumerate(genre_names)}
        item_genres = [[code[g] for g in n] for n in names]
    else:
        raise GemDataError(f"{d}: no MovieLens-100k files (u.data or ml-100k.inter); run "
                           "`gem data fetch movielens-100k` or point data.path at them")
    user_ids = np.array([int(row[0]) for row in users])
    n_users = max(int(user_ids.max()), int(ratings[:, 0].max())) + 1
    occupations = tuple(sorted({row[3] for row in users}))
    age = np.zeros(n_users, dtype=np.int64)
    gender = np.zeros(n_users, dtype=np.int64)
    occupation = np.zeros(n_users, dtype=np.int64)
    age[user_ids] = [int(row[1]) for row in users]
    gender[user_ids] = [1 if row[2] == "F" else 0 for row in users]
    occupation[user_ids] = [occupations.index(row[3]) for row in users]
    n_items = max(max(item_ids), int(ratings[:, 1].max())) + 1
    year = np.zeros(n_items, dtype=np.int64)
    year[item_ids] = years
    if any(not g for g in item_genres) or len(set(item_ids)) < n_items:
        # Movies without a genre (or absent from the item file) get a genre of their own.
        genre_names = list(genre_names) + [NO_GENRE]
        item_genres = [g or [len(genre_names) - 1] for g in item_genres]
        missing = sorted(set(range(n_items)) - set(item_ids))
        item_ids = list(item_ids) + missing
        item_genres = list(item_genres) + [[len(genre_names) - 1]] * len(missing)
    lengths = np.zeros(n_items, dtype=np.int64)
    lengths[item_ids] = [len(g) for g in item_genres]
    order = np.argsort(item_ids)  # genre bags laid out by item id
    genre_offsets = np.zeros(n_items + 1, dtype=np.int64)
    np.cumsum(lengths, out=genre_offsets[1:])
    genre_values = np.array([g for i in order for g in item_genres[i]], dtype=np.int64)
    return RawMovieLens(
        user=ratings[:, 0], item=ratings[:, 1], rating=ratings[:, 2], timestamp=ratings[:, 3],
        age=age, gender=gender, occupation=occupation, occupations=occupations, year=year,
        genre_offsets=genre_offsets, genre_values=genre_values, genres=tuple(genre_names))


def _year(text: str) -> int:
    text = text.strip()
    return int(text) if text.isdigit() else 0


def movielens_schema(raw: RawMovieLens, max_history: int) -> FeatureSchema:
    """Tables and features of the converted data set (ids are the files' ids: dense policy)."""
    return FeatureSchema(
        tables=(
            EmbeddingTable(name="movie", num_embeddings=raw.year.size),
            EmbeddingTable(name="rating", num_embeddings=5),
            EmbeddingTable(name="genre", num_embeddings=len(raw.genres)),
            EmbeddingTable(name="decade", num_embeddings=NUM_DECADES),
            EmbeddingTable(name="user_id", num_embeddings=raw.age.size),
            EmbeddingTable(name="age_bucket", num_embeddings=AGE_EDGES.size + 1),
            EmbeddingTable(name="gender", num_embeddings=2),
            EmbeddingTable(name="occupation", num_embeddings=max(len(raw.occupations), 1)),
        ),
        event_features=(
            SequenceFeature(name="movie", table="movie"),
            SequenceFeature(name="rating", table="rating"),
            SequenceFeature(name="genres", table="genre", multi_valued=True),
            SequenceFeature(name="decade", table="decade"),
        ),
        candidate_features=(
            SequenceFeature(name="movie", table="movie"),
            SequenceFeature(name="genres", table="genre", multi_valued=True),
            SequenceFeature(name="decade", table="decade"),
        ),
        sparse_features=(
            ContextFeature(name="user_id", table="user_id"),
            ContextFeature(name="age_bucket", table="age_bucket"),
            ContextFeature(name="gender", table="gender"),
            ContextFeature(name="occupation", table="occupation"),
        ),
        num_dense=2, tasks=("like",), max_seq_len=max_history,
    )


def request_groups(user: np.ndarray, ts: np.ndarray, window_s: int) -> np.ndarray:
    """For ratings sorted by (user, time), the index of the rating that opens each one's request:
    a request opens at a user's first rating and at every rating more than ``window_s`` seconds
    after the opening rating of the current request (0: one request per distinct timestamp)."""
    n = user.size
    opener = np.zeros(n, dtype=np.int64)
    new_user = np.r_[True, user[1:] != user[:-1]]
    if window_s == 0:
        # Vectorised: a new request wherever the user or the timestamp changes.
        starts = new_user | np.r_[True, ts[1:] != ts[:-1]]
        return np.maximum.accumulate(np.where(starts, np.arange(n), 0))
    # A window chains from each request's opening rating: one pass over the ratings.
    current = 0
    for i in range(n):
        if new_user[i] or ts[i] > ts[current] + window_s:
            current = i
        opener[i] = current
    return opener


def build_impressions(raw: RawMovieLens, *, max_history: int, eval_fraction: float,
                      window_s: int = 0) -> tuple[FeatureSchema, dict[str, JaggedBatch]]:
    """Per split, all its requests as one batch (in time order).

    A request is a set of ratings of one user at the same timestamp (or within ``window_s``
    seconds of the request's first rating, see :func:`request_groups`); its time is its first
    rating's, its candidates are those ratings (ordered by movie id) and its history is the
    user's ratings strictly before that time (at most ``max_history``, the most recent).
    Requests at or after the ``1 - eval_fraction`` quantile of request times are held out.
    """
    order = np.lexsort((raw.item, raw.timestamp, raw.user))
    user, item = raw.user[order], raw.item[order]
    rating, ts = raw.rating[order], raw.timestamp[order]
    n = order.size
    opener = request_groups(user, ts, window_s)
    openers = np.flatnonzero(opener == np.arange(n))  # one per request, in (user, time) order
    cand_offsets = np.r_[openers, n]
    request_user, request_ts = user[openers], ts[openers]
    first = np.r_[True, user[1:] != user[:-1]]
    user_start = np.maximum.accumulate(np.where(first, np.arange(n), 0))
    # Ratings sorted by (user, time): those strictly before the request are exactly the
    # user's ratings before its opening rating (a same-time rating opens or joins it).
    history_end = openers
    history_start = np.maximum(user_start[openers], history_end - max_history)
    past = np.concatenate([[0], np.cumsum(rating)])
    position = history_end - user_start[openers]
    mean_past = np.where(position > 0, (past[history_end] - past[user_start[openers]])
                         / np.maximum(position, 1) - 3.0, 0.0)
    count = openers.size
    threshold = np.sort(request_ts)[min(int(count * (1.0 - eval_fraction)), count - 1)]
    schema = movielens_schema(raw, max_history)
    splits = {}
    for split, mask in (("train", request_ts < threshold), ("eval", request_ts >= threshold)):
        requests = np.flatnonzero(mask)
        requests = requests[np.argsort(request_ts[requests], kind="stable")]
        splits[split] = _batch(raw, requests, history_start, history_end, cand_offsets,
                               request_user, request_ts, user, item, rating, ts, position,
                               mean_past)
    return schema, splits


def _gather(starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Offsets of the ranges ``starts[i]:stops[i]`` laid back to back, and their positions."""
    lengths = stops - starts
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return offsets, np.arange(int(offsets[-1])) + np.repeat(starts - offsets[:-1], lengths)


def _decade(year: np.ndarray) -> np.ndarray:
    return np.where(year > 0, np.clip(year // 10 - 191, 0, NUM_DECADES - 2) + 1, 0).astype(
        np.int64)


def _genres(raw: RawMovieLens, movies: np.ndarray) -> Jagged:
    offsets, index = _gather(raw.genre_offsets[movies], raw.genre_offsets[movies + 1])
    return Jagged(torch.from_numpy(raw.genre_values[index]), torch.from_numpy(offsets))


def _batch(raw: RawMovieLens, requests: np.ndarray, history_start: np.ndarray,
           history_end: np.ndarray, cand_offsets: np.ndarray, request_user: np.ndarray,
           request_ts: np.ndarray, user: np.ndarray, item: np.ndarray, rating: np.ndarray,
           ts: np.ndarray, position: np.ndarray, mean_past: np.ndarray) -> JaggedBatch:
    offsets, events = _gather(history_start[requests], history_end[requests])
    c_offsets, cands = _gather(cand_offsets[requests], cand_offsets[requests + 1])
    u = request_user[requests]
    single = torch.arange(requests.size + 1)
    t = torch.from_numpy
    movies, candidates = item[events], item[cands]
    return JaggedBatch(
        seq_offsets=t(offsets), seq_timestamps=t(ts[events]),
        event_ids={"movie": t(movies), "rating": t(rating[events] - 1),
                   "genres": _genres(raw, movies), "decade": t(_decade(raw.year[movies]))},
        request_timestamps=t(request_ts[requests]),
        candidate_offsets=t(c_offsets),
        candidate_ids={"movie": t(candidates), "genres": _genres(raw, candidates),
                       "decade": t(_decade(raw.year[candidates]))},
        labels={"like": t((rating[cands] >= 4).astype(np.float32))},
        sparse={
            "user_id": Jagged(t(u), single),
            "age_bucket": Jagged(t(np.searchsorted(AGE_EDGES, raw.age[u], side="right")), single),
            "gender": Jagged(t(raw.gender[u]), single),
            "occupation": Jagged(t(raw.occupation[u]), single),
        },
        dense=t(np.stack([np.log1p(position[requests]) / 5.0, mean_past[requests]], axis=1)
                .astype(np.float32)),
        user_ids=t(u),
    )


def write_movielens(raw_dir: str | Path, out: str | Path, *, max_history: int = 256,
                    eval_fraction: float = 0.1, window_s: int = 0,
                    row_group_rows: int = 8192) -> Manifest:
    """Convert the raw files in ``raw_dir`` into a Parquet data set in ``out``."""
    from gem_data.writer import DatasetWriter

    raw = read_movielens(raw_dir)
    schema, splits = build_impressions(raw, max_history=max_history, eval_fraction=eval_fraction,
                                       window_s=window_s)
    info = {"source": "movielens-100k", "raw": str(raw_dir), "max_history": max_history,
            "eval_fraction": eval_fraction, "window_s": window_s,
            "label": "like = rating >= 4",
            "genres": list(raw.genres), "occupations": list(raw.occupations)}
    writer = DatasetWriter(out, schema, row_group_rows=row_group_rows, info=info)
    for split, batch in splits.items():
        writer.write(split, batch)
    return writer.close()
