"""Resolving every pluggable part of a run once, before anything is built."""

from __future__ import annotations

from typing import Any

import attrs

from gem_core.config import GemConfig
from gem_core.distributed import ParallelContext
from gem_core.plugins import GemPlugins, Resolved
from gem_core.registry import AutoContext


@attrs.frozen(kw_only=True)
class RunBackends:
    """The loaded implementation of each kind for one run, and why each was chosen."""

    attention: Resolved
    norm: Resolved
    embedding: Resolved
    dense_sharding: Resolved
    embedding_sharding: Resolved
    precision: Resolved
    activation_checkpointing: Resolved
    balancer: Resolved
    data: Resolved

    def describe(self) -> dict[str, dict[str, Any]]:
        return {
            kind: {
                "name": resolved.spec.name,
                "reason": resolved.reason,
                "package": resolved.spec.distribution,
                "version": resolved.spec.version,
            }
            for kind, resolved in attrs.asdict(self, recurse=False).items()
        }


def resolve_backends(config: GemConfig, plugins: GemPlugins, ctx: ParallelContext) -> RunBackends:
    """Load what the config names (or what ``auto`` means here); the first failure is fatal."""
    b = config.backends
    # The precision recipe decides the compute dtype that other `auto` choices may depend on.
    base = AutoContext(device=ctx.device.type, world_size=ctx.world_size)
    precision = plugins.resolve("precision", b.precision, base)
    context = attrs.evolve(base, dtype=getattr(precision.impl, "compute_dtype", "float32"))
    return RunBackends(
        attention=plugins.resolve("attention", b.attention, context),
        norm=plugins.resolve("norm", b.norm, context),
        embedding=plugins.resolve("embedding", b.embedding, context),
        dense_sharding=plugins.resolve("dense_sharding", b.dense_sharding, context),
        embedding_sharding=plugins.resolve("embedding_sharding", b.embedding_sharding, context),
        precision=precision,
        activation_checkpointing=plugins.resolve("activation_checkpointing",
                                                 b.activation_checkpointing, context),
        balancer=plugins.resolve("balancer", b.balancer, context),
        data=plugins.resolve("data", config.data.source, context),
    )
