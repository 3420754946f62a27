"""Run configuration: attrs classes, presets and overrides."""

from gem_core.config.loading import (
    DEFAULT_PRESET,
    load_config,
    preset_names,
    structure,
    to_toml,
    unstructure,
)
from gem_core.config.model_schema import EmbeddingOptimizerConfig, ModelConfig
from gem_core.config.moe_schema import MoeConfig
from gem_core.config.schema import (
    AdapterConfig,
    BackendsConfig,
    DataConfig,
    DistillConfig,
    GemConfig,
    ParallelConfig,
    PrecisionConfig,
    TrainConfig,
)

__all__ = [
    "DEFAULT_PRESET",
    "AdapterConfig",
    "BackendsConfig",
    "DataConfig",
    "DistillConfig",
    "EmbeddingOptimizerConfig",
    "GemConfig",
    "ModelConfig",
    "MoeConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "TrainConfig",
    "load_config",
    "preset_names",
    "structure",
    "to_toml",
    "unstructure",
]
