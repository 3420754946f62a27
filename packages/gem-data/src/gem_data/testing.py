"""Small data sets for tests of gem-data and of the packages that train on it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

GENRES = ["unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime",
          "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery",
          "Romance", "Sci-Fi", "Thriller", "War", "Western"]
OCCUPATIONS = ["student", "engineer", "writer", "other"]


def movielens_ratings(seed: int = 0, users: int = 12, items: int = 30,
                      per_user: tuple[int, int] = (3, 25)) -> list[tuple[int, int, int, int]]:
    """``(user, movie, rating, timestamp)`` rows; every user has a tie of two ratings at one
    time (a request with two candidates)."""
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


def write_movielens_sample(directory: Path, *, seed: int = 0, users: int = 12,
                           items: int = 30) -> list[tuple[int, int, int, int]]:
    """A MovieLens-100k directory in GroupLens's own file formats (``u.data``, ``u.user``,
    ``u.item`` with genre flags and release dates, one missing; ``u.genre``); returns the
    ratings written."""
    directory.mkdir(parents=True, exist_ok=True)
    rows = movielens_ratings(seed, users=users, items=items)
    (directory / "u.data").write_text("".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in rows))
    (directory / "u.user").write_text("".join(
        f"{u}|{18 + 3 * u}|{'F' if u % 3 == 0 else 'M'}|{OCCUPATIONS[u % 4]}|0{u:04d}\n"
        for u in range(1, users + 1)))
    lines = []
    for i in range(1, items + 1):
        flags = ["0"] * 19
        flags[i % 19] = "1"
        if i % 4 == 0:
            flags[(i + 5) % 19] = "1"
        date = "" if i == 7 else f"01-Jan-{1950 + i}"
        lines.append(f"{i}|Movie {i} (x)|{date}||http://x/{i}|" + "|".join(flags) + "\n")
    (directory / "u.item").write_text("".join(lines), encoding="latin-1")
    (directory / "u.genre").write_text("".join(f"{g}|{k}\n" for k, g in enumerate(GENRES)))
    return rows
