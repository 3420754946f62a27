"""``gem data fetch movielens-100k``: obtain MovieLens-100k without a browser.

PyPI's ``recbole==1.2.1`` wheel ships the data set as RecBole atomic files under
``recbole/dataset_example/ml-100k/``. pip downloads that wheel (no dependencies, nothing
installed) into a cache folder and the three files are extracted from it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from gem_core.errors import GemDataError

WHEEL_REQUIREMENT = "recbole==1.2.1"
WHEEL_PREFIX = "recbole/dataset_example/ml-100k/"
FILES = ("ml-100k.inter", "ml-100k.user", "ml-100k.item")
CACHE_ENV = "GEM_DATA_CACHE"


def default_cache() -> Path:
    """``$GEM_DATA_CACHE``, else ``~/.cache/gem-data``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "gem-data")


def movielens_raw_dir(cache: str | Path | None = None) -> Path:
    return Path(cache or default_cache()) / "movielens-100k" / "raw"


def fetch_movielens(cache: str | Path | None = None, *, timeout_s: float = 300) -> Path:
    """The directory of the extracted atomic files, downloading the wheel if needed."""
    raw = movielens_raw_dir(cache)
    if all((raw / name).is_file() for name in FILES):
        return raw
    wheels = raw.parent / "wheel"
    wheels.mkdir(parents=True, exist_ok=True)
    wheel = _find_wheel(wheels)
    if wheel is None:
        command = [sys.executable, "-m", "pip", "download", WHEEL_REQUIREMENT, "--no-deps",
                   "--only-binary", ":all:", "--dest", str(wheels), "--quiet"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise GemDataError(f"pip download {WHEEL_REQUIREMENT} took over {timeout_s:.0f} s"
                               ) from None
        wheel = _find_wheel(wheels)
        if done.returncode != 0 or wheel is None:
            raise GemDataError(f"pip could not download {WHEEL_REQUIREMENT} (exit "
                               f"{done.returncode}): {done.stderr.strip()[-600:]}")
    staging = raw.with_name(f"raw.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        with zipfile.ZipFile(wheel) as archive:
            for name in FILES:
                with archive.open(WHEEL_PREFIX + name) as src, open(staging / name, "wb") as dst:
                    shutil.copyfileobj(src, dst)
    except (zipfile.BadZipFile, KeyError) as error:
        shutil.rmtree(staging, ignore_errors=True)
        raise GemDataError(f"{wheel}: not a recbole wheel holding {WHEEL_PREFIX} ({error})"
                           ) from None
    try:
        staging.rename(raw)  # atomic; another process may have won the race, which is fine
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not raw.is_dir():
            raise
    return raw


def _find_wheel(directory: Path) -> Path | None:
    found = sorted(directory.glob("recbole-1.2.1-*.whl"))
    return found[0] if found else None
