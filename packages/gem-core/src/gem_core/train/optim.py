"""Optimizer construction and the learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from gem_core.config import GemConfig, TrainConfig
from gem_core.config.model_schema import EmbeddingOptimizerConfig
from gem_core.model.id_bias import id_bias_parameters
from gem_core.train.table_optimizer import AdamWWithTables, id_bias_group, table_group


def make_optimizer(config: TrainConfig, tables: EmbeddingOptimizerConfig | None = None, *,
                   feature_tables: nn.Module | None = None, id_bias_rate: float = 0.0,
                   id_bias_step: str | None = None, id_bias_prior: str = "fixed"):
    """An optimizer factory for strategies: AdamW, weight decay on dense matrices only, embedding
    weights (``nn.Embedding``/``nn.EmbeddingBag``) at ``train.embedding_lr_scale``. With
    ``tables.dense_tables = "same"`` (or ``auto``), the weights of ``feature_tables`` (the model's
    ``embeddings``, the feature tables of ``[model.embedding_optimizer]``; the model's other
    embeddings, such as the age and position buckets, stay with AdamW) are stepped row-wise by
    ``tables`` instead (:mod:`gem_core.train.table_optimizer`). Strategies call the factory after
    wrapping, so modules are matched by identity: wrapping (DDP, FSDP2, compile) keeps the module
    objects while FSDP2 replaces their parameters. The trainer resolves ``dense_tables = "auto"``
    for its backends at start-up (:func:`gem_core.train.table_optimizer.resolve_table_optimizer`);
    a caller that steps the model itself in one process (the benchmarks) gets ``same`` for it.
    The offsets of ``model.id_bias`` (:class:`gem_core.model.id_bias.IdBias`) are a group of
    their own, stepped per impression by ``id_bias_step`` at ``id_bias_rate`` under an
    ``id_bias_prior`` (:func:`id_bias_group`; the trainer passes
    :func:`gem_core.train.table_optimizer.id_bias_arguments` of ``[model]``)."""
    row_wise = tables is not None and tables.dense_tables in ("same", "auto")
    if row_wise and feature_tables is None:
        raise ValueError("make_optimizer: dense_tables = 'same' needs the feature tables' module")

    def build(module: nn.Module) -> torch.optim.Optimizer:
        no_decay_ids, embedding_ids, table_ids = set(), set(), set()
        if row_wise:
            table_ids = {id(p) for sub in feature_tables.modules()
                         if isinstance(sub, (nn.Embedding, nn.EmbeddingBag))
                         for p in sub.parameters(recurse=False)}
        for sub in module.modules():
            if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)):
                embedding_ids.update(id(p) for p in sub.parameters(recurse=False))
            if isinstance(sub, (nn.LayerNorm, nn.RMSNorm)):
                no_decay_ids.update(id(p) for p in sub.parameters(recurse=False))
        offsets = id_bias_parameters(module)
        if offsets and (id_bias_rate <= 0 or id_bias_step is None):
            raise ValueError("make_optimizer: the model has id_bias offsets; give their rate "
                             "and step (id_bias_rate, id_bias_step: model.id_bias_rate, "
                             "model.id_bias_step)")
        offset_ids = {id(p) for p in offsets}
        decay, no_decay, embeddings, rows = [], [], [], []
        for param in module.parameters():
            if not param.requires_grad or id(param) in offset_ids:
                continue
            # At scale 1 embeddings stay in the no-decay group: the optimizer's groups (and so
            # its checkpointed state) are those of runs from before the option.
            if id(param) in table_ids:
                rows.append(param)
            elif id(param) in embedding_ids and config.embedding_lr_scale != 1.0:
                embeddings.append(param)
            elif id(param) in embedding_ids:
                no_decay.append(param)
            else:
                (no_decay if id(param) in no_decay_ids or param.dim() < 2 else decay).append(param)
        # Engines set each group's lr to the schedule's times its ``lr_scale``.
        groups = [{"params": decay, "weight_decay": config.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0},
                  {"params": embeddings, "weight_decay": 0.0,
                   "lr_scale": config.embedding_lr_scale}]
        if rows:
            groups.append(table_group(rows, tables, config.lr))
        if offsets:
            assert id_bias_step is not None
            groups.append(id_bias_group(offsets, id_bias_rate, id_bias_step, id_bias_prior))
        return AdamWWithTables([g for g in groups if g["params"]], lr=config.lr,
                               betas=(0.9, 0.98), eps=1e-8)

    return build


def lr_schedule(config: GemConfig) -> str:
    """The run's schedule after warm-up (``train.lr_schedule`` with ``auto`` resolved)."""
    chosen = config.train.lr_schedule
    if chosen != "auto":
        return chosen
    return "constant" if config.data.order == "time" else "cosine"


def schedule_steps(config: TrainConfig, requests_per_pass: int | None) -> int:
    """The step the learning-rate schedule ends at: ``train.steps``, or, where the data knows
    its pass length (:meth:`gem_core.contracts.DataSource.requests_per_pass`), the step whose
    batch completes the last of ``train.epochs`` passes when that comes first. Without this a
    run that one pass ends early (MovieLens-100k at batch 256: step 174 of 300) would stop
    with its learning rate still near half of ``lr``."""
    if not config.epochs or not requests_per_pass:
        return config.steps
    return min(config.steps, math.ceil(config.epochs * requests_per_pass / config.batch_size))


def learning_rate(config: TrainConfig, step: int, schedule: str = "cosine",
                  last_step: int | None = None) -> float:
    """Linear warm-up to ``lr``, then (``cosine``) cosine decay to 10 % of it at the last step
    (``last_step``, default ``train.steps``; see :func:`schedule_steps`), or (``constant``)
    ``lr``."""
    if config.warmup_steps and step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if schedule == "constant":
        return config.lr
    span = max((config.steps if last_step is None else last_step) - config.warmup_steps, 1)
    progress = min((step - config.warmup_steps) / span, 1.0)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
