"""gem-data's plugin module, named by its `gem` entry point. Registration only: no heavy imports.

Every ``load`` imports its module when a run or command selects it, so ``gem --help`` and
``gem plugins`` never import pyarrow or torchrec through this package.
"""

from __future__ import annotations

from typing import Any

from gem_core import hookimpl
from gem_core.capabilities import TIME_WINDOWS
from gem_core.registry import ImplementationSpec, lazy


def _load_parquet() -> Any:
    from gem_data.sources import parquet_factory

    return parquet_factory


def _load_movielens() -> Any:
    from gem_data.movielens_source import movielens_factory

    return movielens_factory


def _load_synthetic_ads() -> Any:
    from gem_data.synthetic_source import synthetic_ads_factory

    return synthetic_ads_factory


def _load_data_cli() -> Any:
    from gem_data.cli import data_group

    return data_group


def _load_bench_loader() -> Any:
    from gem_data.bench import bench_loader

    return bench_loader


@hookimpl
def gem_register_data_sources(register: Any) -> None:
    register(ImplementationSpec(
        name="parquet", load=_load_parquet, requires=("pyarrow",),
        options=lazy("gem_data.sources", "ParquetOptions"),
        # data.order = "time" on a data set with time windows (gem data import --append)
        capabilities=(TIME_WINDOWS,),
        description="Parquet data set directory (gem data synth / fetch): streamed, sharded, "
                    "resumable, validated; time windows in order (data.order = time)"))
    register(ImplementationSpec(
        name="movielens-100k", load=_load_movielens, requires=("pyarrow",),
        options=lazy("gem_data.movielens_source", "MovieLensOptions"),
        description="MovieLens-100k ratings as impressions (history -> movie, like = rating >= 4), "
                    "split by time"))
    register(ImplementationSpec(
        name="synthetic-ads", load=_load_synthetic_ads,
        options=lazy("gem_data.synthetic_source", "SyntheticAdsOptions"),
        description="The full synthetic ads-log generator, in memory (no files)"))


@hookimpl
def gem_register_cli_commands(register: Any) -> None:
    register(ImplementationSpec(
        name="data", load=_load_data_cli, requires=("pyarrow",),
        description="Make, obtain, check and describe data sets (synth, fetch, validate, inspect)"))
    register(ImplementationSpec(
        name="bench.loader", load=_load_bench_loader, requires=("pyarrow",),
        description="Loader throughput from Parquet to batches, ours vs the TorchRec KJT path"))
    register(ImplementationSpec(
        name="bench.import", load=lazy("gem_data.bench_import", "bench_import"),
        requires=("pyarrow",),
        description="gem data import with each engine (numpy, duckdb, spark) on the same "
                    "generated logs: rows/s and peak memory"))
    register(ImplementationSpec(
        name="export-user-embeddings",
        load=lazy("gem_data.export_user_embeddings", "export_user_embeddings"),
        requires=("pyarrow",),
        description="Run a trained upstream tower over its data; write data + user embeddings"))
    register(ImplementationSpec(
        name="distill-precompute",
        load=lazy("gem_data.distill_precompute", "distill_precompute"), requires=("pyarrow",),
        description="Write a data set plus a teacher's logits and user embeddings (gem distill)"))
    register(ImplementationSpec(
        name="score", load=lazy("gem_data.score", "score_command"), requires=("pyarrow",),
        description="Score a Parquet data set with an exported model (gem export-model)"))
