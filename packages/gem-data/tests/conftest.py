"""Shared fixtures: small request-level data sets (format 2) written with the real writer.

The data come from :func:`gem_data.bench.make_requests` with :data:`SCHEMA`, a schema that has
every kind of feature: dense-policy tables, a hashed 64-bit id table, multi-valued event and
candidate features, context bags, per-event and per-candidate content vectors and 1-3
candidates per request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from gem_core.batch import JaggedBatch
from gem_core.schema import ContextFeature, EmbeddingTable, FeatureSchema, SequenceFeature
from gem_data.bench import make_requests, write_requests
from gem_data.writer import DatasetWriter

SCHEMA = FeatureSchema(
    tables=(EmbeddingTable(name="item", num_embeddings=500),
            EmbeddingTable(name="action", num_embeddings=3),
            EmbeddingTable(name="genre", num_embeddings=20),
            EmbeddingTable(name="ad", num_embeddings=1000, id_policy="hash"),
            EmbeddingTable(name="advertiser", num_embeddings=20),
            EmbeddingTable(name="category", num_embeddings=12),
            EmbeddingTable(name="segment", num_embeddings=64),
            EmbeddingTable(name="context", num_embeddings=16, id_policy="modulo")),
    event_features=(SequenceFeature(name="item", table="item"),
                    SequenceFeature(name="action", table="action"),
                    SequenceFeature(name="genres", table="genre", multi_valued=True),
                    SequenceFeature(name="ad_id", table="ad")),
    candidate_features=(SequenceFeature(name="item", table="item"),
                        SequenceFeature(name="advertiser", table="advertiser"),
                        SequenceFeature(name="category", table="category"),
                        SequenceFeature(name="genres", table="genre", multi_valued=True,
                                        pooling="sum"),
                        SequenceFeature(name="ad_id", table="ad")),
    sparse_features=(ContextFeature(name="segment", table="segment"),
                     ContextFeature(name="context", table="context")),
    num_dense=4, seq_dense_dim=3, candidate_content=True, tasks=("click", "conversion"),
    max_seq_len=64,
)

OPTIONS = dict(mean_length=12.0, max_length=64, max_candidates=3)


def chunk(rows: int, seed: int = 3, index: int = 0) -> JaggedBatch:
    """Generated requests of :data:`SCHEMA`."""
    return make_requests(SCHEMA, rows, seed=seed, index=index, **OPTIONS)


@pytest.fixture(scope="session")
def schema() -> FeatureSchema:
    """:data:`SCHEMA`."""
    return SCHEMA


@pytest.fixture(scope="session")
def make_chunk() -> Callable[..., JaggedBatch]:
    """:func:`chunk`: generated requests of :data:`SCHEMA`."""
    return chunk


@pytest.fixture(scope="session")
def data_options() -> dict:
    """The generator options of the fixtures' data sets."""
    return dict(OPTIONS)


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3000 train requests in row groups of 256, 500 eval requests."""
    out = tmp_path_factory.mktemp("small") / "data"
    write_requests(out, SCHEMA, rows=3000, seed=7, eval_rows=500, row_group_rows=256, **OPTIONS)
    return out


@pytest.fixture
def make_dataset(tmp_path: Path) -> Callable[..., Path]:
    """Write one generated chunk (optionally altered by ``mutate``) as a data set."""

    def make(rows: int = 64, mutate: Callable[[JaggedBatch], JaggedBatch] | None = None,
             row_group_rows: int = 32, name: str = "data") -> Path:
        batch = chunk(rows)
        if mutate is not None:
            batch = mutate(batch)
        writer = DatasetWriter(tmp_path / name, SCHEMA, row_group_rows=row_group_rows)
        writer.write("train", batch)
        writer.write("eval", chunk(16, index=1))
        writer.close()
        return tmp_path / name

    return make
