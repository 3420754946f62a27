"""Reading checkpoint files without running code from them.

Run directories are copied between people and machines, so a checkpoint is untrusted input. A
pickle can run any code while it loads, so nothing in a checkpoint is unpickled by Python's
``pickle`` or by ``torch.load(weights_only=False)``:

- the trainer state is ``trainer.json`` (plain JSON, with tags for tuples, numpy values and
  non-string keys) plus ``trainer-tensors.pt``, a dict of tensors (RNG states, numpy arrays as
  tensors) loaded with ``torch.load(weights_only=True)``;
- DCP's ``.metadata`` (a pickle DCP writes) goes through :class:`_MetadataUnpickler`, which builds
  only DCP's metadata classes and the torch types they hold; the non-tensor values DCP stores in
  its ``.distcp`` files (optimizer hyperparameters) load with ``weights_only=True``
  (:class:`SafeLoadPlanner`); every DCP load goes through :func:`load_dcp` or :func:`read_dcp`;
- ``engine.pt`` (full-state engines: DeepSpeed ZeRO) loads with ``weights_only=True``, allowing
  only the library classes the strategy that wrote it declares
  (:attr:`gem_core.contracts.DenseSharding.checkpoint_classes`).

A file that asks for anything else is refused with :class:`~gem_core.errors.GemCheckpointError`
naming the file and what it asked for.
"""

from __future__ import annotations

import collections
import importlib
import io
import json
import pathlib
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.storage import StorageMeta

from gem_core.errors import GemCheckpointError

_TAG = "__gem__"
"""Key that marks an encoded value in ``trainer.json`` (a plain dict never holds it: dicts that
would are encoded as items)."""

_NUMPY_KINDS = "biuf"
"""numpy dtype kinds a checkpoint may hold (bool, int, uint, float): never objects."""


# -- trainer state: JSON plus tensors ---------------------------------------------------------

def write_trainer_state(state: dict[str, Any], json_file: Path, tensors_file: Path) -> None:
    """Write ``state`` (nested dicts, lists, tuples, str, int, float, bool, None, tensors,
    numpy arrays and scalars) as JSON plus a tensor file. Anything else is a programming error,
    named by its place in ``state``."""
    tensors: dict[str, torch.Tensor] = {}
    encoded = _encode(state, tensors, "state")
    torch.save(tensors, tensors_file)
    json_file.write_text(json.dumps(encoded))


def read_trainer_state(json_file: Path, tensors_file: Path) -> dict[str, Any]:
    """The state :func:`write_trainer_state` wrote, rebuilt without unpickling anything but
    tensors (``weights_only=True``)."""
    try:
        encoded = json.loads(json_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise GemCheckpointError(f"{json_file} is not valid JSON ({error})") from None
    tensors = load_tensors(tensors_file)
    if not isinstance(tensors, dict) or not all(torch.is_tensor(t) for t in tensors.values()):
        raise GemCheckpointError(f"{tensors_file} holds {type(tensors).__name__}, not a dict "
                                 "of tensors")
    return _decode(encoded, tensors, json_file)


def _encode(value: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(value, np.generic):  # first: np.float64 is also a float
        return {_TAG: "numpy_scalar", "dtype": value.dtype.str, "value": value.item()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if torch.is_tensor(value) or isinstance(value, np.ndarray):
        key = f"t{len(tensors)}"
        if isinstance(value, np.ndarray):
            tensors[key] = torch.from_numpy(np.ascontiguousarray(value).copy())
            return {_TAG: "ndarray", "key": key}
        tensors[key] = value.detach().cpu().clone()
        return {_TAG: "tensor", "key": key}
    if isinstance(value, tuple):
        return {_TAG: "tuple", "items": [_encode(v, tensors, f"{where}[{i}]")
                                         for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and _TAG not in value:
            return {k: _encode(v, tensors, f"{where}.{k}") for k, v in value.items()}
        return {_TAG: "dict", "items": [[_encode(k, tensors, f"{where} key"),
                                         _encode(v, tensors, f"{where}[{k!r}]")]
                                        for k, v in value.items()]}
    raise TypeError(f"{where} is a {type(value).__name__}; the trainer state holds only plain "
                    "data, tensors and numpy values")


def _decode(value: Any, tensors: dict[str, torch.Tensor], source: Path) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors, source) for v in value]
    if not isinstance(value, dict):
        return value
    tag = value.get(_TAG)
    if tag is None:
        return {k: _decode(v, tensors, source) for k, v in value.items()}
    if tag == "tuple":
        return tuple(_decode(v, tensors, source) for v in value["items"])
    if tag == "dict":
        return {_hashable(_decode(k, tensors, source)): _decode(v, tensors, source)
                for k, v in value["items"]}
    if tag in ("tensor", "ndarray"):
        key = value["key"]
        if key not in tensors:
            raise GemCheckpointError(f"{source} refers to tensor {key!r}, which its tensor file "
                                     "does not hold")
        return tensors[key].numpy() if tag == "ndarray" else tensors[key]
    if tag == "numpy_scalar":
        dtype = np.dtype(str(value["dtype"]))
        if dtype.kind not in _NUMPY_KINDS:
            raise GemCheckpointError(f"{source} holds a numpy value of dtype {dtype}, which a "
                                     "checkpoint never holds")
        return dtype.type(value["value"])
    raise GemCheckpointError(f"{source} holds an unknown {_TAG} tag {tag!r}")


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


def load_tensors(file: Path, *, allowed: tuple[str, ...] = ()) -> Any:
    """``torch.load(weights_only=True)`` of ``file``, allowing also the classes named in
    ``allowed`` (imported by name only when the file refers to them). A file that refers to
    any other global is refused before loading, naming what it refers to."""
    try:
        referred = torch.serialization.get_unsafe_globals_in_checkpoint(str(file))
    except (RuntimeError, OSError, ValueError, pickle.UnpicklingError) as error:
        raise GemCheckpointError(f"{file} is not a readable tensor file ({error})") from None
    refused = sorted(set(referred) - set(allowed))
    if refused:
        raise GemCheckpointError(
            f"{file} refers to {', '.join(refused)}, which a checkpoint never holds; it was "
            "not loaded (a pickle can run code). Do not trust this run directory: start over "
            "with --fresh or another --out")
    classes = [_import(name) for name in referred]
    try:
        with torch.serialization.safe_globals(classes):
            return torch.load(file, map_location="cpu", weights_only=True)
    except (RuntimeError, OSError, ValueError, EOFError, pickle.UnpicklingError) as error:
        raise GemCheckpointError(f"{file} cannot be read ({_first_line(error)})") from None


def _import(qualified: str) -> Any:
    module, _, name = qualified.rpartition(".")
    return getattr(importlib.import_module(module), name)


# -- full-state engines: engine.pt -------------------------------------------------------------

def load_full_engine_state(file: Path, *, allowed: tuple[str, ...]) -> dict[str, Any]:
    """A full-state engine's ``engine.pt`` (``{"model": ..., "optimizer": ...}``), loaded with
    ``weights_only=True``; ``allowed``: the library classes (qualified names) it may hold
    besides tensors and plain data, those the strategy that wrote it declares
    (:attr:`gem_core.contracts.DenseSharding.checkpoint_classes`). No other class is built."""
    state = load_tensors(file, allowed=allowed)
    if not isinstance(state, dict) or "model" not in state:
        raise GemCheckpointError(f"{file} holds no engine state (no 'model' entry)")
    return state


# -- DCP ---------------------------------------------------------------------------------------

def _dcp_metadata_classes() -> dict[tuple[str, str], Any]:
    from torch.distributed.checkpoint import metadata
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    classes = (metadata.Metadata, metadata.MetadataIndex, metadata.StorageMeta,
               metadata.TensorProperties, metadata.TensorStorageMetadata,
               metadata.BytesStorageMetadata, metadata.ChunkStorageMetadata,
               metadata._MEM_FORMAT_ENCODING)
    allowed: dict[tuple[str, str], Any] = {
        ("torch.distributed.checkpoint.metadata", cls.__name__): cls for cls in classes}
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
    allowed.update({("torch", name): dtype for name, dtype in vars(torch).items()
                    if isinstance(dtype, torch.dtype)})
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    # StorageMeta.checkpoint_id: the path the checkpoint was written to (informational).
    allowed[("pathlib", "PosixPath")] = pathlib.PosixPath
    allowed[("pathlib", "PurePosixPath")] = pathlib.PurePosixPath
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes, torch dtypes and sizes; refuses every other global."""

    allowed = _dcp_metadata_classes()

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get((module, name))
        if found is not None:
            return found
        raise pickle.UnpicklingError(f"refers to {module}.{name}")


def read_dcp_metadata(directory: Path) -> Metadata:
    """DCP's ``.metadata`` of ``directory``, read with :class:`_MetadataUnpickler`."""
    file = Path(directory) / ".metadata"
    try:
        with open(file, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
    except pickle.UnpicklingError as error:
        raise GemCheckpointError(
            f"{file} {error}, which DCP metadata never holds; it was not loaded (a pickle can "
            "run code). Do not trust this run directory: start over with --fresh or another "
            "--out") from None
    except (OSError, EOFError, ValueError, TypeError, AttributeError, IndexError) as error:
        raise GemCheckpointError(f"{file} cannot be read ({_first_line(error)})") from None
    if not isinstance(metadata, Metadata):
        raise GemCheckpointError(f"{file} holds {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with :func:`read_dcp_metadata` (its tensors already load with
    ``weights_only=True``)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank is not None:  # per-rank metadata files are a layout gem never writes
            raise GemCheckpointError(f"{self.path}: per-rank DCP metadata is not supported")
        metadata = read_dcp_metadata(Path(self.path))
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeBytes:
    """``load_bytes`` of DCP's planners with ``weights_only=True``: DCP stores non-tensor values
    (optimizer hyperparameters) as ``torch.save`` bytes in the ``.distcp`` files."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            raise GemCheckpointError(
                f"the value of {fqn!r} in the DCP files {_first_line(error)}; it was not "
                "loaded (a pickle can run code). Do not trust this run directory") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


class SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
    """DCP's default load planner, non-tensor values loaded with ``weights_only=True``."""


class _SafeEmptyStateDictLoadPlanner(_SafeBytes, _EmptyStateDictLoadPlanner):
    """Rebuilds the whole saved state dict from the metadata (for :func:`read_dcp`)."""


def load_dcp(state: dict[str, Any], directory: Path, *, no_dist: bool) -> None:
    """``dcp.load`` of ``directory`` into ``state`` in place, safely (every rank together).

    flatten_sharded_tensors=False: that step (for FSDP1's nested ShardedTensors) drops a
    ShardedTensor with no shard on this rank (a table another rank holds), and DCP then takes
    the checkpoint's key for it as a sign of a pre-2.4 checkpoint and looks up every key in that
    older format."""
    import torch.distributed.checkpoint as dcp

    read_dcp_metadata(directory)  # its errors as themselves: DCP would fold them into others
    with _unwrapped_checkpoint_errors():
        dcp.load(state, storage_reader=SafeFileSystemReader(directory),
                 planner=SafeLoadPlanner(flatten_sharded_tensors=False), no_dist=no_dist)


def read_dcp(directory: Path) -> dict[str, Any]:
    """The whole state dict of a DCP directory, full tensors, in this process (no collectives)."""
    state: dict[str, Any] = {}
    read_dcp_metadata(directory)  # its errors as themselves: DCP would fold them into others
    with _unwrapped_checkpoint_errors():
        _load_state_dict(state, storage_reader=SafeFileSystemReader(directory),
                         planner=_SafeEmptyStateDictLoadPlanner(), no_dist=True)
    return state


class _unwrapped_checkpoint_errors:
    """DCP wraps every rank's exception into one ``CheckpointException`` holding their
    tracebacks; a :class:`GemCheckpointError` among them is raised as itself (its message is
    the user's answer)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: BaseException | None, traceback: Any) -> bool:
        if isinstance(error, CheckpointException):
            for failure in error.failures.values():
                cause = failure[0] if isinstance(failure, tuple) else failure
                if isinstance(cause, GemCheckpointError):
                    raise cause from None
        return False


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
