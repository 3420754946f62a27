"""The one place where a model is made ready for its devices, in a fixed order."""

from __future__ import annotations

from typing import Callable

from torch import nn

from gem_core.compile import compile_model, compiler_settings
from gem_core.config import GemConfig
from gem_core.distributed import ParallelContext
from gem_core.engine import Engine
from gem_core.errors import GemConfigError
from gem_core.plugins import Resolved


def parallelize(
    model: nn.Module,
    *,
    ctx: ParallelContext,
    precision: Resolved,
    embedding_sharding: Resolved,
    activation_checkpointing: Resolved,
    dense_sharding: Resolved,
    make_optimizer: Callable,
    config: GemConfig,
) -> Engine:
    """Apply precision, embedding sharding, activation checkpointing and dense sharding to
    ``model``; return its Engine. Each strategy (the precision recipe included) is the run's
    resolved choice, applied with its options as resolved (structured once, from the kind's
    table: ``[precision.options]``, ``[parallel.*]``)."""
    model = model.to(ctx.device)
    # 1. Precision conversion first: module swaps (FP8 linears) must see the plain modules, and
    #    sharding must then shard the converted parameters (FP8 all-gather needs that order).
    model = precision.impl.convert(model, ctx, precision.options)
    # 2. Embedding sharding: the tables leave the replicated parameter set before the dense
    #    strategy wraps what remains.
    model = embedding_sharding.impl.apply(model, ctx=ctx, options=embedding_sharding.options)
    # 3. Activation checkpointing wraps blocks before dense sharding, so that FSDP shards the
    #    checkpointed blocks (their parameters are gathered again for the recomputation).
    model = activation_checkpointing.impl.apply(model, ctx=ctx,
                                                options=activation_checkpointing.options)
    # 4. Compile (train.compile) the checkpointed blocks before FSDP wraps them: FSDP2's
    #    gather/free hooks stay outside the compiled graphs. A policy that recomputes through
    #    the compiler (an activation memory budget) hands its settings to the compilation.
    settings = compiler_settings(activation_checkpointing.impl, activation_checkpointing.options)
    if config.train.compile:
        compile_model(model, ctx=ctx, config=config, settings=settings)
    elif settings:
        raise GemConfigError(
            f"activation_checkpointing {config.backends.activation_checkpointing!r} lets the "
            f"compiler choose what to recompute ({', '.join(sorted(settings))}); it needs "
            "train.compile = true")
    # 5. Dense sharding last: it wraps or shards the final module tree and builds the optimizer.
    return dense_sharding.impl.apply(model, ctx=ctx, make_optimizer=make_optimizer,
                                     precision=precision.impl, options=dense_sharding.options)
