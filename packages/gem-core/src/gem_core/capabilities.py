"""The names of the capabilities an implementation may declare in its registration
(``ImplementationSpec.capabilities``), checked at start-up against what a run asks for.

This is the one module that exports them: gem-core, the plugins and their tests import them from
here. The registrations are the one source of who declares what: a message that names the
implementations able to do something builds the list from the registry with :func:`declared_by`,
never from a list written by hand (``tests/test_capability_messages.py`` checks it). Plain strings
in a module that imports nothing first-party, so that every layer can read them."""

from __future__ import annotations

from typing import Any, Iterable

MANAGED_IDS = "managed_ids"
"""Capability of an embedding backend that remaps the raw ids of ``id_policy = "managed"`` tables
itself, and of an embedding sharding that keeps that remapping the same on every rank (checked at
start-up by :func:`gem_core.ids.check_managed_ids`)."""

# Capabilities of attention backends (checked at start-up, all of them, by
# :func:`gem_core.attention.choice.check_attention_backend`).
SOFTMAX = "softmax"
"""The backend computes softmax attention (``AttentionParams.normalization``)."""

SILU = "silu"
"""The backend computes HSTU's pointwise SiLU attention, ``silu(scale * q.k) / n``."""

NORMALIZATIONS: tuple[str, ...] = (SOFTMAX, SILU)
"""Every attention normalisation (``model.normalization``); a backend declares those it computes."""

RELATIVE_BIAS = "relative_bias"
"""The backend adds HSTU's relative attention bias (``bias=RelativeBias(...)``), with gradients
for its weights."""

TORCH_EXPORT = "torch_export"
"""``torch.export`` can capture the backend with dynamic batch and lengths (no data-dependent
Python control flow, no custom op without an export registration): what ``gem export-model``
needs of the run's attention backend."""

FUSED_OPTIMIZER = "fused_optimizer"
"""Capability of an embedding backend whose module trains its tables itself, inside the backward,
with ``[model.embedding_optimizer]``: the tables are not parameters of the module (the dense
optimizer never sees them, no dense strategy reduces their gradients) and the module checkpoints
its optimizer state as a :class:`gem_core.contracts.ShardedModule` (checked at start-up by
:func:`gem_core.embedding.check_fused_optimizer`)."""

TABLE_OPTIMIZER = "table_optimizer"
"""Capability of a dense sharding whose engine steps the optimizer that ``make_optimizer`` built,
on the parameters as the module holds them (whole tensors, or dim-0 shards as DTensors), after
reducing their gradients: a parameter group may then keep one state value per table row, sharded
with the rows. What ``[model.embedding_optimizer] dense_tables = "same"`` needs (checked at
start-up by :func:`gem_core.train.table_optimizer.resolve_table_optimizer`); DeepSpeed, which
flattens parameters into partitions of its own, does not declare it."""

TORCH_COMPILE = "torch_compile"
"""``torch.compile`` traces the backend whole (``fullgraph``: no graph break, no data-dependent
Python control flow; custom ops with fake implementations are fine) with dynamic token and batch
dimensions: what ``train.compile`` needs of the run's attention backend."""

TIME_WINDOWS = "time_windows"
"""Capability of a data source that can stream its training data in time order, window after
window, and evaluate each window on its own (:class:`gem_core.contracts.WindowedSource`): what
``data.order = "time"`` needs (checked at start-up by :mod:`gem_core.train.time_order`)."""

ATTENTION_CAPABILITIES: tuple[str, ...] = (*NORMALIZATIONS, RELATIVE_BIAS, TORCH_EXPORT,
                                           TORCH_COMPILE)
"""Every capability an attention backend may declare: the normalisations it computes and its
optional features."""

DECLARED_CAPABILITIES: tuple[str, ...] = (MANAGED_IDS, FUSED_OPTIMIZER, TABLE_OPTIMIZER,
                                          *ATTENTION_CAPABILITIES, TIME_WINDOWS)
"""Every capability name gem-core checks."""

WHO_DECLARES = "gem plugins lists what each implementation declares"
"""What a message says where it cannot see the registry (a backend called directly)."""


def declared_by(specs: Iterable[Any], *capabilities: str) -> str:
    """The names of ``specs`` (registered ``ImplementationSpec`` s of one kind) that declare
    every one of ``capabilities``, sorted and comma separated, or ``none installed``: the list a
    message offers instead of one written by hand."""
    names = sorted(spec.name for spec in specs if set(capabilities) <= set(spec.capabilities))
    return ", ".join(names) or "none installed"
