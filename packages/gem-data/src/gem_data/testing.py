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


def write_generated_windows(out: Path, *, windows: int, upto: int | None = None,
                            rows_per_window: int = 96, seed: int = 0, num_items: int = 300,
                            row_group_rows: int = 32, file_rows: int = 64) -> list[str]:
    """A time-windowed data set in ``out`` cut from one generated chunk sorted by request time:
    ``windows`` windows of about ``rows_per_window`` requests (``day-0``, ``day-1``, ...), of
    which the first ``upto`` are written; windows already in ``out`` are kept and the next are
    appended, so calling it again with a larger ``upto`` grows the data set as ``gem data
    import --append`` would. Returns the names of the windows now in ``out``."""
    import pyarrow.compute as pc

    from gem_data.arrow_io import batch_to_table
    from gem_data.generator import AdsLogGenerator
    from gem_data.manifest import read_manifest
    from gem_data.synth_options import SynthOptions
    from gem_data.windows import WindowWriter, publish_windows

    generator = AdsLogGenerator(SynthOptions(num_items=num_items), seed=seed)
    table = batch_to_table(generator.chunk(rows_per_window * windows, split="train", index=0),
                           generator.schema)
    table = table.take(pc.sort_indices(table, [("request_timestamp", "ascending")]))
    times = table.column("request_timestamp").to_numpy()
    bounds = np.linspace(0, len(times), windows + 1).astype(int)
    for i in range(1, windows):  # a cut between two requests of one second moves past them
        while bounds[i] < len(times) and times[bounds[i]] == times[bounds[i] - 1]:
            bounds[i] += 1
    previous = read_manifest(out) if (out / "manifest.json").is_file() else None
    for index in range(len(previous.windows) if previous else 0, upto or windows):
        writer = WindowWriter(out, generator.schema, f"day-{index}",
                              row_group_rows=row_group_rows, file_rows=file_rows)
        writer.write(table.slice(bounds[index], bounds[index + 1] - bounds[index]))
        previous = publish_windows(out, generator.schema, [writer.window()], writer.entries,
                                   previous=previous)
    return [window.name for window in previous.windows]


def hashed_log_schema(*, max_seq_len: int, eval_fraction: float) -> str:
    """The schema TOML (with its ``[import]`` table) of the small raw logs the import tests
    write: hashed 64-bit ``ad`` ids, a multi-valued ``topics`` list on events and candidates,
    a ``seg`` request feature and one dense column, ``score``; ``click`` the one task."""
    return (f'tasks = ["click"]\nmax_seq_len = {max_seq_len}\nnum_dense = 1\n'
            '[[tables]]\nname = "ad"\nnum_embeddings = 1000\nid_policy = "hash"\n'
            '[[tables]]\nname = "topic"\nnum_embeddings = 97\nid_policy = "hash"\n'
            '[[tables]]\nname = "seg"\nnum_embeddings = 13\nid_policy = "hash"\n'
            '[[event_features]]\nname = "ad"\ntable = "ad"\n'
            '[[event_features]]\nname = "topics"\ntable = "topic"\nmulti_valued = true\n'
            '[[candidate_features]]\nname = "ad"\ntable = "ad"\n'
            '[[candidate_features]]\nname = "topics"\ntable = "topic"\nmulti_valued = true\n'
            '[[sparse_features]]\nname = "seg"\ntable = "seg"\n'
            f'[import]\neval_fraction = {eval_fraction}\ndense_columns = ["score"]\n')
