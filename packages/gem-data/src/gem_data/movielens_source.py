"""The ``movielens-100k`` data source: converts the raw files once, then streams them as Parquet."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

import attrs

from gem_core.config import DataConfig
from gem_core.config.validators import at_least, between
from gem_data.fetch import default_cache, fetch_movielens, movielens_raw_dir
from gem_data.manifest import MANIFEST_NAME
from gem_data.movielens import write_movielens
from gem_data.sources import ParquetOptions, ParquetSource

log = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class MovieLensOptions(ParquetOptions):
    """``[data.options]`` of ``movielens-100k``: the ``parquet`` loader options, plus these."""

    eval_fraction: float = attrs.field(default=0.1, validator=between(0.01, 0.5))
    """Latest share of ratings (by time) held out for evaluation."""

    request_window_s: int = attrs.field(default=0, validator=at_least(0))
    """A request is the ratings a user gave at one timestamp (0) or within this many seconds of
    the request's first rating; its history is the user's ratings strictly before it."""

    download: bool = True
    """Fetch the data set (pip download of the recbole wheel) when it is not cached yet and
    ``data.path`` is empty."""

    cache_dir: str = ""
    """Where raw and converted files live; empty: ``$GEM_DATA_CACHE`` or ``~/.cache/gem-data``."""


def converted_dir(raw_dir: Path, cache: Path, max_history: int, eval_fraction: float,
                  window_s: int = 0) -> Path:
    """Where the Parquet conversion of ``raw_dir`` with these settings is kept."""
    key = hashlib.sha1(f"v2|{raw_dir.resolve()}|{max_history}|{eval_fraction}|{window_s}"
                       .encode()).hexdigest()
    return cache / "movielens-100k" / f"parquet-{key[:12]}"


def prepare(config: DataConfig, options: MovieLensOptions) -> Path:
    """A Parquet data set directory for this config: ``data.path`` if it is one already, else the
    (cached) conversion of the raw files at ``data.path`` or in the cache."""
    cache = Path(options.cache_dir) if options.cache_dir else default_cache()
    if config.path and (Path(config.path) / MANIFEST_NAME).is_file():
        return Path(config.path)
    if config.path:
        raw = Path(config.path)
    elif options.download:
        raw = fetch_movielens(cache)
    else:
        raw = movielens_raw_dir(cache)
    out = converted_dir(raw, cache, config.max_seq_len, options.eval_fraction,
                        options.request_window_s)
    if (out / MANIFEST_NAME).is_file():
        return out
    staging = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    log.info("converting MovieLens-100k from %s into %s", raw, out)
    write_movielens(raw, staging, max_history=config.max_seq_len,
                    eval_fraction=options.eval_fraction, window_s=options.request_window_s)
    try:
        staging.rename(out)  # ranks converting at once: the first rename wins, others reuse it
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def movielens_factory(config: DataConfig, *, seed: int, options: MovieLensOptions
                      ) -> ParquetSource:
    source = ParquetSource(config, seed=seed, options=options, directory=prepare(config, options))
    source.name = "movielens-100k"
    return source
