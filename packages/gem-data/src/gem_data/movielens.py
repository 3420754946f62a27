"""MovieLens-100k as ads-style impressions, from GroupLens files or RecBole atomic files.

Each rating is one impression: the candidate is the rated movie, the history is the user's earlier
ratings (ordered by time, ties by movie id; at most ``max_history`` most recent), the history's
action is the rating (1-5 -> action 0-4), and the label ``like`` is rating >= 4. Non-sequence
features: user id, age bucket, gender, occupation and the candidate's genres (multi-hot); the
candidate's release decade is a candidate feature; two dense features say how long and how
positive the user's past is. The split is by time: impressions at or after the
``1 - eval_fraction`` quantile of rating times are held out, so no training impression (nor its
history) comes from the evaluation period.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np
import torch

from gem_core.batch import JaggedBatch
from gem_core.errors import GemDataError
from gem_core.jagged import Jagged
from gem_core.schema import FeatureSchema, SparseFeature

from gem_data.manifest import Manifest
from gem_data.writer import DatasetWriter

AGE_EDGES = np.array([18, 25, 35, 45, 50, 56])
NUM_DECADES = 11  # 0: unknown year, 1..10: 1920s and earlier .. 2010s


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
        item_genres = [[g for g, flag in enumerate(row[5:]) if flag.strip() == "1"] for row in items]
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
    return FeatureSchema(
        num_items=raw.year.size, num_actions=5,
        sparse_features=(
            SparseFeature(name="user_id", num_embeddings=raw.age.size),
            SparseFeature(name="age_bucket", num_embeddings=AGE_EDGES.size + 1),
            SparseFeature(name="gender", num_embeddings=2),
            SparseFeature(name="occupation", num_embeddings=max(len(raw.occupations), 1)),
            SparseFeature(name="genres", num_embeddings=max(len(raw.genres), 1)),
        ),
        candidate_features=(SparseFeature(name="release_decade", num_embeddings=NUM_DECADES),),
        num_dense=2, tasks=("like",), max_seq_len=max_history,
    )


def build_impressions(raw: RawMovieLens, *, max_history: int, eval_fraction: float,
                      ) -> tuple[FeatureSchema, dict[str, JaggedBatch]]:
    """Per split, all its impressions as one batch (rows in time order)."""
    order = np.lexsort((raw.item, raw.timestamp, raw.user))
    user, item = raw.user[order], raw.item[order]
    rating, ts = raw.rating[order], raw.timestamp[order]
    n = order.size
    first = np.r_[True, user[1:] != user[:-1]]
    user_start = np.maximum.accumulate(np.where(first, np.arange(n), 0))
    position = np.arange(n) - user_start  # earlier ratings of the same user
    start = np.maximum(user_start, np.arange(n) - max_history)
    past = np.concatenate([[0], np.cumsum(rating)])
    mean_past = np.where(position > 0, (past[np.arange(n)] - past[user_start])
                         / np.maximum(position, 1) - 3.0, 0.0)
    threshold = np.sort(ts)[min(int(n * (1.0 - eval_fraction)), n - 1)]
    schema = movielens_schema(raw, max_history)
    splits = {}
    for split, mask in (("train", ts < threshold), ("eval", ts >= threshold)):
        rows = np.flatnonzero(mask)
        rows = rows[np.argsort(ts[rows], kind="stable")]
        splits[split] = _batch(raw, rows, start, user, item, rating, ts, position, mean_past)
    return schema, splits


def _batch(raw: RawMovieLens, rows: np.ndarray, start: np.ndarray, user: np.ndarray,
           item: np.ndarray, rating: np.ndarray, ts: np.ndarray, position: np.ndarray,
           mean_past: np.ndarray) -> JaggedBatch:
    lengths = rows - start[rows]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    events = np.arange(int(offsets[-1])) + np.repeat(start[rows] - offsets[:-1], lengths)
    candidate = item[rows]
    g_lengths = np.diff(raw.genre_offsets)[candidate]
    g_offsets = np.concatenate([[0], np.cumsum(g_lengths)])
    g_index = np.arange(int(g_offsets[-1])) + np.repeat(raw.genre_offsets[candidate]
                                                        - g_offsets[:-1], g_lengths)
    u = user[rows]
    single = torch.arange(rows.size + 1)
    year = raw.year[candidate]
    decade = np.where(year > 0, np.clip(year // 10 - 191, 0, NUM_DECADES - 2) + 1, 0)
    t = torch.from_numpy
    return JaggedBatch(
        seq_offsets=t(offsets), seq_item_ids=t(item[events]),
        seq_action_ids=t(rating[events] - 1), seq_timestamps=t(ts[events]),
        request_timestamps=t(ts[rows]), candidate_item_ids=t(candidate),
        labels={"like": t((rating[rows] >= 4).astype(np.float32))},
        sparse={
            "user_id": Jagged(t(u), single),
            "age_bucket": Jagged(t(np.searchsorted(AGE_EDGES, raw.age[u], side="right")), single),
            "gender": Jagged(t(raw.gender[u]), single),
            "occupation": Jagged(t(raw.occupation[u]), single),
            "genres": Jagged(t(raw.genre_values[g_index]), t(g_offsets)),
        },
        candidate_sparse={"release_decade": t(decade.astype(np.int64))},
        dense=t(np.stack([np.log1p(position[rows]) / 5.0, mean_past[rows]], axis=1)
                .astype(np.float32)),
    )


def write_movielens(raw_dir: str | Path, out: str | Path, *, max_history: int = 256,
                    eval_fraction: float = 0.1, row_group_rows: int = 8192) -> Manifest:
    """Convert the raw files in ``raw_dir`` into a Parquet data set in ``out``."""
    raw = read_movielens(raw_dir)
    schema, splits = build_impressions(raw, max_history=max_history, eval_fraction=eval_fraction)
    info = {"source": "movielens-100k", "raw": str(raw_dir), "max_history": max_history,
            "eval_fraction": eval_fraction, "label": "like = rating >= 4",
            "genres": list(raw.genres), "occupations": list(raw.occupations)}
    writer = DatasetWriter(out, schema, row_group_rows=row_group_rows, info=info)
    for split, batch in splits.items():
        writer.write(split, batch)
    return writer.close()
