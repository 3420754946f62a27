"""The GEM model: built from a config, a feature schema and injected backends."""

from gem_core.model.gem import GEMModel, build_model, embedding_tables

__all__ = ["GEMModel", "build_model", "embedding_tables"]
