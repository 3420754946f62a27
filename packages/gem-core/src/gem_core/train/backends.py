"""Resolving every pluggable part of a run once, before anything is built.

The kinds a run resolves, and the config key naming each choice, come from the table of kinds
(:data:`gem_core.kinds.RUN_KINDS`); :class:`RunBackends` has one field per such kind.
"""

from __future__ import annotations

from typing import Any

import attrs

from gem_core.attention.choice import check_attention_backend
from gem_core.config import GemConfig
from gem_core.distributed import ParallelContext
from gem_core.kinds import RUN_KINDS
from gem_core.plugins import GemPlugins, Resolved
from gem_core.registry import AutoContext


def _describe(self: Any) -> dict[str, dict[str, Any]]:
    """Per kind: the chosen name, why, and the package (and version) it came from."""
    return {
        kind: {
            "name": resolved.spec.name,
            "reason": resolved.reason,
            "package": resolved.spec.distribution,
            "version": resolved.spec.version,
        }
        for kind, resolved in attrs.asdict(self, recurse=False).items()
    }


RunBackends = attrs.make_class(
    "RunBackends",
    {kind.name: attrs.field(type=Resolved) for kind in RUN_KINDS},
    frozen=True,
    kw_only=True,
)
RunBackends.__doc__ = ("The loaded implementation of each kind for one run (one field per row of "
                       "gem_core.kinds.RUN_KINDS: attention, norm, ...), and why each was chosen.")
RunBackends.__module__ = __name__
RunBackends.describe = _describe


def resolve_backends(config: GemConfig, plugins: GemPlugins, ctx: ParallelContext, *,
                     training: bool = True) -> RunBackends:
    """Load what the config names (or what ``auto`` means here) for every kind a run chooses;
    the first failure is fatal. The precision recipe is resolved first: its declared
    ``activation_dtype`` is the dtype every other choice must accept (and ``auto`` hooks see).
    What the model asks of the attention backend (normalisations, relative bias) is checked
    against the backend's declared capabilities before anything is built."""
    base = AutoContext(device=ctx.device.type, world_size=ctx.world_size, training=training,
                       compile=config.train.compile)
    precision = plugins.resolve("precision", config.backends.precision, base,
                                config.precision.options)
    context = attrs.evolve(base, dtype=precision.spec.activation_dtype)
    resolved = {kind.name: (precision if kind.name == "precision" else
                            plugins.resolve(kind.name, kind.chosen_in(config), context,
                                            kind.options_in(config)))
                for kind in RUN_KINDS}
    backends = RunBackends(**resolved)
    check_attention_backend(config.model, backends.attention.spec,
                            plugins.registry("attention").specs())
    return backends
