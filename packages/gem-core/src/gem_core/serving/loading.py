"""The one way this repository loads a program of an export directory.

:func:`load_program` takes the manifest :func:`gem_core.serving.integrity.open_export` verified,
reads the program's file once into memory, checks those bytes against the manifest's digest
(what is loaded is what was verified), refuses code in them
(:func:`gem_core.serving.archive.inspect_program`) and only then hands them to torch. Every
failure is one :class:`GemDataError` naming the file. Verification happens once, at load: a
loaded program is torch's own module, called as it is.

An AOTInductor package (``--aoti``) is a compiled shared library: loading it runs its native
code by design. Its digest and payload configs are checked, but only load one you exported.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from gem_core.checkpoint.digests import ALGORITHM
from gem_core.errors import GemDataError
from gem_core.serving.archive import first_sentence, inspect_program
from gem_core.serving.integrity import MANIFEST, inside

Program = Callable[[dict[str, Tensor]], Mapping[str, Tensor]]


def _verified_bytes(directory: Path, manifest: dict[str, Any], name: str) -> tuple[Path, bytes]:
    path = inside(directory, name, f"{Path(directory) / MANIFEST}")
    record = manifest["files"].get(name)
    if record is None:
        raise GemDataError(f"{path}: not recorded in {MANIFEST}; export the run again")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise GemDataError(f"{path}: missing; the export is incomplete: export the run "
                           "again") from None
    except OSError as error:
        raise GemDataError(f"{path}: unreadable ({error.strerror})") from None
    if len(data) != record["bytes"]:
        raise GemDataError(f"{path}: {len(data)} bytes, written as {record['bytes']} "
                           "(truncated, overwritten or replaced); export the run again")
    if hashlib.new(ALGORITHM, data).hexdigest() != record[ALGORITHM]:
        raise GemDataError(f"{path}: content differs from its {ALGORITHM} digest in "
                           f"{MANIFEST} (damaged, or another export's file); export the run "
                           "again")
    return path, data


def load_program(directory: Path, manifest: dict[str, Any], program: str, *,
                 aoti: bool = False) -> Program:
    """Program ``program`` of the export in ``directory`` (its ``.pt2``, or with ``aoti`` its
    AOTInductor package), as a callable of the flat input dict."""
    entry = manifest["programs"][program]
    if aoti:
        if "aoti_file" not in entry:
            raise GemDataError(f"{directory} has no AOTInductor package of {program!r}; "
                               "export with gem export-model --aoti")
        path, data = _verified_bytes(directory, manifest, entry["aoti_file"])
        inspect_program(data, str(path), native=True)
        from torch._inductor import aoti_load_package

        try:
            return aoti_load_package(str(path))
        except Exception as error:  # noqa: BLE001 - torch's loader, reported in one line
            raise GemDataError(f"{path}: torch could not load the AOTInductor package "
                               f"({type(error).__name__}: {first_sentence(error)})"
                               ) from None
    path, data = _verified_bytes(directory, manifest, entry["file"])
    return program_from_bytes(data, path)


def program_from_bytes(data: bytes, path: Path) -> Program:
    """The program a ``.pt2`` file's bytes ``data`` hold (read from ``path``), checked against
    the loaders' rules (:func:`~gem_core.serving.archive.inspect_program`) before torch
    unpickles it. Raises GemDataError naming the file where either refuses it."""
    inspect_program(data, str(path))
    try:
        return torch.export.load(io.BytesIO(data)).module()
    except Exception as error:  # noqa: BLE001 - torch's loader, reported in one line
        raise GemDataError(f"{path}: torch could not load the program "
                           f"({type(error).__name__}: {first_sentence(error)})"
                           ) from None
