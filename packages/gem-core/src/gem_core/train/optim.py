"""Optimizer construction and the learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from gem_core.config import GemConfig, TrainConfig


def make_adamw(config: TrainConfig):
    """An optimizer factory for strategies: AdamW, weight decay on dense matrices only."""

    def build(module: nn.Module) -> torch.optim.Optimizer:
        no_decay_ids = set()
        for sub in module.modules():
            if isinstance(sub, (nn.Embedding, nn.EmbeddingBag, nn.LayerNorm, nn.RMSNorm)):
                no_decay_ids.update(id(p) for p in sub.parameters(recurse=False))
        decay, no_decay = [], []
        for param in module.parameters():
            if not param.requires_grad:
                continue
            (no_decay if id(param) in no_decay_ids or param.dim() < 2 else decay).append(param)
        groups = [{"params": decay, "weight_decay": config.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=config.lr,
                                 betas=(0.9, 0.98), eps=1e-8)

    return build


def lr_schedule(config: GemConfig) -> str:
    """The run's schedule after warm-up (``train.lr_schedule`` with ``auto`` resolved)."""
    chosen = config.train.lr_schedule
    if chosen != "auto":
        return chosen
    return "constant" if config.data.order == "time" else "cosine"


def learning_rate(config: TrainConfig, step: int, schedule: str = "cosine") -> float:
    """Linear warm-up to ``lr``, then (``cosine``) cosine decay to 10 % of it at the last step,
    or (``constant``) ``lr``."""
    if config.warmup_steps and step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if schedule == "constant":
        return config.lr
    span = max(config.steps - config.warmup_steps, 1)
    progress = min((step - config.warmup_steps) / span, 1.0)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
