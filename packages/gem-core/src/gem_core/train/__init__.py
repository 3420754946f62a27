"""The trainer: resolves backends, builds the model, runs the loop, writes the run directory."""

from gem_core.train.trainer import TrainResult, train

__all__ = ["TrainResult", "train"]
