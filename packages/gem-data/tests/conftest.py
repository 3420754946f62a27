"""Shared fixtures: small generated data sets written with the real writer."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from gem_core.batch import JaggedBatch
from gem_data.generator import AdsLogGenerator, SynthOptions
from gem_data.synth import synthesize
from gem_data.writer import DatasetWriter

SMALL = SynthOptions(num_items=500, num_users=200, num_clusters=8, num_advertisers=20,
                     mean_length=12.0, max_length=64)


@pytest.fixture(scope="session")
def small_options() -> SynthOptions:
    """Generator options of the small data sets (tests compare against the generator)."""
    return SMALL


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3000 train rows in row groups of 256, 500 eval rows."""
    out = tmp_path_factory.mktemp("small") / "data"
    synthesize(out, rows=3000, seed=7, eval_rows=500, options=SMALL, row_group_rows=256)
    return out


@pytest.fixture
def make_dataset(tmp_path: Path) -> Callable[..., Path]:
    """Write one generated chunk (optionally altered by ``mutate``) as a data set."""

    def make(rows: int = 64, mutate: Callable[[JaggedBatch], JaggedBatch] | None = None,
             row_group_rows: int = 32, name: str = "data") -> Path:
        generator = AdsLogGenerator(SMALL, seed=3)
        batch = generator.chunk(rows, split="train", index=0)
        if mutate is not None:
            batch = mutate(batch)
        writer = DatasetWriter(tmp_path / name, generator.schema, row_group_rows=row_group_rows)
        writer.write("train", batch)
        writer.write("eval", generator.chunk(16, split="eval", index=0))
        writer.close()
        return tmp_path / name

    return make
