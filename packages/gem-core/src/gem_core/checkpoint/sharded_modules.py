"""Sharded modules: modules of the model whose state the dense engine's state dict does not hold
(TorchRec-sharded embedding tables and their fused optimizer,
:mod:`gem_parallel.torchrec.sharding`), and how the checkpointer stores them.

Such a module subclasses :class:`gem_core.contracts.ShardedModule` and offers its state through
its four methods (every rank calls them together):

- ``sharded_checkpoint_state()``: ``{"model": {name: tensor}, "optimizer": {name: {state:
  tensor}}}``, live ``ShardedTensor``s that DCP writes shard by shard and loads into in place,
  resharding by offsets (background saves copy their local shards to CPU first);
- ``checkpoint_layout()``: plain data recorded in ``trainer.json`` (``sharded_modules``);
- ``check_checkpoint_layout(saved)``: raises ``GemConfigError`` when the saved layout's state
  cannot continue in this one (checked before anything loads);
- ``checkpoint_loaded()``: after loading.

They are stored as ``model.<module>.<name>`` and ``optimizer.state.<module>.<name>.<state>``,
where an unsharded module's parameters and their dense optimizer's state would be, so the names
do not depend on the layout: in the engine's DCP directory, or, with full-state engines
(DeepSpeed ZeRO, ``engine.pt``), in a DCP directory of their own beside it. The module itself
contributes nothing to the model's state dict: DCP's ``get_state_dict`` cannot name tensors that
are not in the module tree.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from gem_core.checkpoint.io import read_dcp_metadata
from gem_core.contracts import ShardedModule
from gem_core.engine import Engine
from gem_core.errors import GemConfigError


def find(engine: Engine) -> dict[str, Any]:
    """The model's sharded modules (see the module docstring) by their names in the model."""
    return {name: module for name, module in engine.unwrapped.named_modules()
            if isinstance(module, ShardedModule)}


def collect(modules: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every sharded module's ``sharded_checkpoint_state()``, by module name."""
    return {name: module.sharded_checkpoint_state() for name, module in modules.items()}


def attach(state: dict[str, Any], modules: dict[str, dict[str, Any]], *,
           nested: bool = False) -> dict[str, Any]:
    """Add the sharded modules' tensors (:func:`collect`) to an engine's ``{"model",
    "optimizer"}`` state dict (see the module docstring); returns them by the flat names DCP
    stores them under, or (``nested``) ``state`` itself."""
    flat: dict[str, Any] = {}
    optimizer = state["optimizer"].setdefault("state", {})
    for module_name, module_parts in modules.items():
        for name, tensor in module_parts["model"].items():
            key = f"{module_name}.{name}"
            if key in state["model"]:
                raise RuntimeError(f"{key} is both in the engine's state dict and a sharded "
                                   "module's")
            state["model"][key] = tensor
            flat[f"model.{key}"] = tensor
        for name, values in module_parts["optimizer"].items():
            key = f"{module_name}.{name}"
            optimizer[key] = values
            flat.update({f"optimizer.state.{key}.{state_name}": tensor
                         for state_name, tensor in values.items()})
    return state if nested else flat


def standalone(modules: dict[str, Any]) -> dict[str, Any]:
    """The sharded modules' tensors alone, as :func:`attach` names them (for a DCP directory of
    their own beside a full-state engine's file)."""
    return attach({"model": {}, "optimizer": {}}, collect(modules), nested=True)


def flat_names(state: dict[str, Any]) -> dict[str, Any]:
    """Flat DCP names of an :func:`attach`-ed ``{"model", "optimizer"}`` dict's tensors."""
    flat = {f"model.{k}": v for k, v in state["model"].items()}
    for key, values in state["optimizer"].get("state", {}).items():
        flat.update({f"optimizer.state.{key}.{n}": t for n, t in values.items()})
    return flat


class Stager(DefaultStager):
    """DCP's background staging (the engine's state copied to CPU before the write thread
    starts) plus the sharded modules' ``ShardedTensor``s, which DCP's own stager cannot copy (it
    calls ``data_ptr()``, which ShardedTensor does not support in torch 2.13): their local shards
    are copied here and attached to the staged state dict."""

    def __init__(self, modules: dict[str, Any]) -> None:
        super().__init__(StagingOptions(False, False, False, False))  # synchronous, as DCP's
        self._modules = modules

    def stage(self, state_dict: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        staged = super().stage(state_dict, **kwargs)
        copies = {name: {"model": {k: _cpu_copy(v) for k, v in live["model"].items()},
                         "optimizer": {k: {n: _cpu_copy(t) for n, t in states.items()}
                                       for k, states in live["optimizer"].items()}}
                  for name, live in collect(self._modules).items()}
        attach(staged, copies)
        return staged


def _cpu_copy(tensor: Any) -> Any:
    """A ``ShardedTensor`` with CPU copies of ``tensor``'s local shards, same global layout; a
    CPU copy of a plain tensor (one process's whole state, e.g. fbgemm-tbe's optimizer)."""
    import torch
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata

    if not isinstance(tensor, ShardedTensor):
        if isinstance(tensor, torch.Tensor):
            return tensor.detach().to("cpu", copy=True)
        raise RuntimeError(f"background checkpoints stage sharded modules' tensors only, "
                           f"not {type(tensor).__name__}")

    def on_cpu(meta: ShardMetadata) -> ShardMetadata:
        return ShardMetadata(shard_offsets=list(meta.shard_offsets),
                             shard_sizes=list(meta.shard_sizes),
                             placement=f"rank:{meta.placement.rank()}/cpu")

    metadata = copy.copy(tensor.metadata())
    metadata.shards_metadata = [on_cpu(m) for m in metadata.shards_metadata]
    shards = [Shard(shard.tensor.detach().to("cpu", copy=True), on_cpu(shard.metadata))
              for shard in tensor.local_shards()]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, metadata, process_group=tensor._process_group)


def detach(state: dict[str, Any], flat: dict[str, Any]) -> None:
    """Take :func:`attach`'s entries out again (the engine's loader knows only its own)."""
    for key in flat:
        if key.startswith("model."):
            state["model"].pop(key[len("model."):], None)
        else:
            state["optimizer"]["state"].pop(key[len("optimizer.state."):].rsplit(".", 1)[0], None)


def check_saved_shapes(directory: Path, state: dict[str, Any], flat: dict[str, Any]) -> None:
    """Every sharded-module tensor must be in the DCP ``directory`` with the same global shape
    (DCP reshards by offsets within a shape, not across shapes)."""
    if not flat:
        return
    path = directory.parent
    metadata = read_dcp_metadata(directory).state_dict_metadata  # nothing unpickled
    for key, tensor in flat.items():
        saved = metadata.get(key)
        if saved is None:
            raise GemConfigError(
                f"{path} has no {key} (written with embedding sharding "
                f"{state.get('embedding_sharding')!r}); resume with that or use --fresh")
        shape = tuple(saved.size) if isinstance(saved, TensorStorageMetadata) else ()
        if shape != tuple(tensor.size()):
            raise GemConfigError(f"{path}: {key} has shape {list(shape)} there and "
                                 f"{list(tensor.size())} in this run; use --fresh")


def check_layouts(path: Path, state: dict[str, Any], modules: dict[str, Any]) -> None:
    """Refuse a checkpoint whose sharded modules this run does not have, or has where the
    checkpoint kept the module in the dense engine, or whose layout cannot continue here."""
    saved = state.get("sharded_modules", {})
    embedding = state.get("embedding_sharding")
    for name in sorted(set(saved) - set(modules)):
        kind = saved[name].get("kind")
        if "selected_by" in saved[name]:  # a backend's own tables, not an embedding sharding
            raise GemConfigError(
                f"{path} holds {name!r} as {kind!r} tables with their own fused optimizer "
                f"state ({saved[name].get('optimizer')}), and this run keeps {name!r} in the "
                f"dense engine, whose optimizer cannot continue from that state; resume with "
                f"--set {saved[name]['selected_by']} or use --fresh")
        raise GemConfigError(
            f"{path} holds {name!r} as {kind!r} shards with their own sparse optimizer "
            f"state ({saved[name].get('optimizer')}), and this run keeps {name!r} in the "
            f"dense engine, whose optimizer cannot continue from that state; resume with "
            f"--embedding-sharding {kind} (any number of ranks, one process included) or "
            "use --fresh")
    for name in sorted(set(modules) - set(saved)):
        layout = modules[name].checkpoint_layout()
        kind = layout.get("kind")
        if "selected_by" in layout:
            backend = state.get("config", {}).get("backends", {}).get("embedding")
            raise GemConfigError(
                f"{path} holds {name!r} in the dense engine, with its optimizer's state, and "
                f"this run's {name!r} ({layout['selected_by']}) trains with a fused optimizer "
                f"that cannot continue from it; resume with backends.embedding={backend} or "
                "use --fresh")
        if embedding == kind:  # written before the tables were saved as shards
            raise GemConfigError(
                f"{path} holds {name!r} in an older format ({name}._extra_state: full tables "
                "and per-rank sparse optimizer state), which this version does not read; "
                "resume it with the version that wrote it or use --fresh")
        raise GemConfigError(
            f"{path} was written with embedding sharding {embedding!r}: it holds no "
            f"{kind!r} shards of {name!r} nor their sparse optimizer state; resume with "
            f"--embedding-sharding {embedding} or use --fresh")
    for name, module in modules.items():
        try:
            module.check_checkpoint_layout(saved[name])
        except GemConfigError as error:
            raise GemConfigError(f"{path}: {error}") from None
