"""What a ``.pt2`` program archive may hold before torch is let to load it: data, not code.

``torch.export.load`` runs code an archive can carry: it unpickles (``weights_only=False``)
weights and constants marked ``use_pickle``, custom and opaque objects, legacy weight files and
sample inputs that fail the safe unpickler; it loads AOTInductor shared libraries it finds; it
``exec``'s the program's ``guards_code`` and hands expression strings to ``sympy.sympify``
(``eval``); and a graph node may name any callable under ``torch``, ``math`` or ``operator``.
:func:`inspect_program` reads the archive with torch's own reader (so it sees the records torch
will read) and refuses each of these, naming the archive and the entry, before anything loads:

* payload configs (``data/weights/*_weights_config.json``, ``data/constants/...``): no entry
  ``use_pickle``, constants plain tensors (``tensor_*``), no legacy ``.pt`` payloads;
* sample inputs: readable by ``torch.load(weights_only=True)``;
* no ``data/aotinductor/`` (native code) in a program loaded with ``torch.export.load``, and no
  top-level ``version`` (the pre-2.8 format, whose loader unpickles);
* ``models/*.json``: guards and symbolic expressions of literals, symbols and arithmetic only;
  node targets ``torch.ops.*`` operators, a few ``operator``/``math`` functions, ``torch.sym_*``.
"""

from __future__ import annotations

import ast
import io
import json
import re
import zipfile
from typing import Any

import torch
from torch.export.pt2_archive import constants as pt2

from gem_core.errors import GemDataError

#: ``operator`` functions a graph may call (torch's symbolic-shape arithmetic).
_OPERATORS = frozenset(
    "add sub mul truediv floordiv mod pow neg pos abs eq ne lt le gt ge and_ or_ xor not_ "
    "invert truth getitem lshift rshift".split())
_TARGET = re.compile(r"torch\.ops\.(?P<ns>[A-Za-z_]\w*)(\.[A-Za-z_]\w*){1,2}|"
                     r"torch\.sym_[a-z_]+|math\.[a-z][a-z0-9_]*|_operator\.(?P<op>[a-z_]+)")
#: What a guard may read: input shapes, ``math``, and torch's two guard helpers.
_GUARD_METHODS = frozenset({"size", "stride", "storage_offset", "dim", "numel"})
_GUARD_NAMES = frozenset({"L", "math", "inf", "IsNonOverlappingAndDenseIndicator",
                          "cast_symbool_to_symint_guardless"})
_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?|[-+]?inf|nan")
_SYMBOL = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
_BARE_SYMBOL = re.compile(r"[A-Za-z]+[0-9]+")


def first_sentence(error: BaseException) -> str:
    """The first sentence of ``error``'s message (torch's run to paragraphs), for one line."""
    return str(error).splitlines()[0].split(". ")[0][:160] if str(error) else type(error).__name__


def _refuse(where: str, what: str) -> GemDataError:
    return GemDataError(f"{where}: {what}; refusing to load it (an export holds tensors and "
                        "operators only: export the run again, from a source you trust)")


def _sympy_names() -> dict[str, Any]:
    """Names an expression string may call: sympy's and torch's sympy classes, and sympy's
    singletons (``true``, ``oo``)."""
    import sympy
    from torch.utils._sympy import functions

    names: dict[str, Any] = {}
    for module in (sympy, functions):
        for name in dir(module):
            value = getattr(module, name)
            if not name.startswith("_") and (
                    (isinstance(value, type) and issubclass(value, sympy.Basic))
                    or isinstance(value, sympy.Basic)):
                names[name] = value
    return names


def _check_expression(text: Any, where: str, names: dict[str, Any]) -> None:
    """A sympy ``srepr`` string (``Max(Integer(1), Symbol('s0', integer=True))``): calls of
    sympy classes on literals and symbol names only (``sympify`` ``eval``'s it)."""
    import sympy

    def fail(why: str) -> GemDataError:
        return _refuse(where, f"expression {str(text)[:120]!r} {why}")

    if not isinstance(text, str):
        raise fail("is not a string")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise fail("does not parse") from None

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Constant):
            if not isinstance(node.value, (bool, int, float)):
                raise fail(f"has a literal {node.value!r} where a number belongs")
        elif isinstance(node, ast.Name):
            if node.id not in names and not _BARE_SYMBOL.fullmatch(node.id):
                raise fail(f"names {node.id!r}")
            if node.id in names and isinstance(names[node.id], type):
                raise fail(f"uses class {node.id!r} without calling it")
        elif isinstance(node, ast.Call):
            if not (isinstance(node.func, ast.Name) and node.func.id in names
                    and isinstance(names[node.func.id], type)):
                raise fail(f"calls {ast.unparse(node.func)!r}")
            cls = names[node.func.id]
            for i, arg in enumerate(node.args):
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    symbol = i == 0 and issubclass(cls, sympy.Symbol)
                    if not (symbol and _SYMBOL.fullmatch(arg.value)) and not (
                            issubclass(cls, sympy.Float) and _NUMBER.fullmatch(arg.value)):
                        raise fail(f"passes the string {arg.value!r} to {node.func.id}")
                else:
                    visit(arg)
            for keyword in node.keywords:
                if not (keyword.arg and isinstance(keyword.value, ast.Constant)
                        and isinstance(keyword.value.value, (bool, int))):
                    raise fail(f"passes {ast.unparse(keyword)!r} to {node.func.id}")
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            visit(node.operand)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult,
                                                                  ast.Div, ast.Pow)):
            visit(node.left)
            visit(node.right)
        else:
            raise fail(f"holds {type(node).__name__}")

    visit(tree.body)


def _check_guard(text: Any, where: str) -> None:
    """A guard (``L['inputs']['x'].size()[0] == L['inputs']['y'].size()[0]``, ``... >= 2``):
    comparisons and arithmetic of input shapes and numbers (torch ``exec``'s it)."""
    def fail(why: str) -> GemDataError:
        return _refuse(where, f"guard {str(text)[:120]!r} {why}")

    if not isinstance(text, str):
        raise fail("is not a string")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise fail("does not parse") from None
    allowed = (ast.Compare, ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.operator, ast.cmpop,
               ast.boolop, ast.unaryop, ast.Load, ast.Subscript)
    keys = {id(node.slice) for node in ast.walk(tree) if isinstance(node, ast.Subscript)}
    for node in ast.walk(tree.body):
        if isinstance(node, ast.Constant):
            if not isinstance(node.value, (bool, int, float)) and not (
                    isinstance(node.value, str) and id(node) in keys):
                raise fail(f"has the literal {node.value!r}")
        elif isinstance(node, ast.Name):
            if node.id not in _GUARD_NAMES:
                raise fail(f"names {node.id!r}")
        elif isinstance(node, ast.Attribute):
            on_math = isinstance(node.value, ast.Name) and node.value.id == "math"
            if node.attr.startswith("_") or not (on_math or node.attr in _GUARD_METHODS):
                raise fail(f"reads attribute {node.attr!r}")
        elif isinstance(node, ast.Call):
            if node.keywords or not isinstance(node.func, (ast.Attribute, ast.Name)):
                raise fail(f"calls {ast.unparse(node.func)!r}")
        elif not isinstance(node, allowed):
            raise fail(f"holds {type(node).__name__}")


def _is_operator(target: str) -> bool:
    """Whether ``torch.ops.NS.OP[.OVERLOAD]`` resolves to an operator (not another attribute
    of ``torch.ops``, such as ``load_library``)."""
    value: Any = torch.ops
    try:
        for part in target.split(".")[2:]:
            value = getattr(value, part)
    except Exception:  # noqa: BLE001 - no such operator: whatever the lookup raises
        return False
    return isinstance(value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket,
                              torch._ops.HigherOrderOperator))


def _check_target(target: Any, where: str) -> None:
    """A graph node's target: a ``torch.ops`` operator, ``torch.sym_*``, a ``math`` function or
    an ``operator`` function of :data:`_OPERATORS` (torch resolves it by attribute path)."""
    match = _TARGET.fullmatch(target) if isinstance(target, str) else None
    if match is None or not (_is_operator(target) if match.group("ns") is not None
                             else match.group("op") in _OPERATORS if match.group("op")
                             else "__" not in target):
        raise _refuse(where, f"a graph node calls {target!r}")


def _check_program_json(model: dict[str, Any], where: str) -> None:
    names, seen = _sympy_names(), set()
    for guard in model.get("guards_code") or []:
        _check_guard(guard, where)

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if key == "expr_str" and not (isinstance(item, str) and item in seen):
                    _check_expression(item, where, names)
                    seen.add(item)
                elif key == "nodes" and isinstance(item, list):
                    for node in item:
                        target = node.get("target") if isinstance(node, dict) else None
                        if not (isinstance(target, str) and target in seen):
                            _check_target(target, where)
                            seen.add(target)
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(model)


def _payload_config(reader: Any, record: str, where: str) -> dict[str, Any]:
    try:
        config = json.loads(reader.get_record(record).decode("utf-8"))["config"]
        if not isinstance(config, dict):
            raise TypeError("not an object")
        return config
    except (RuntimeError, UnicodeDecodeError, ValueError, KeyError, TypeError,
            RecursionError) as error:
        raise GemDataError(f"{where}: {record} is unreadable ({error}); the program is "
                           "damaged: export the run again") from None


def inspect_program(data: bytes, where: str, *, native: bool = False) -> None:
    """Refuse (:class:`GemDataError` naming ``where`` and the entry) an archive ``data`` that
    torch could not load as data alone, or could not read at all. ``native``: an AOTInductor
    package, whose shared library is code by design (its configs are still checked)."""
    try:
        reader = torch._C.PyTorchFileReader(io.BytesIO(data))
        records = list(reader.get_all_records())
        if reader.get_record(pt2.ARCHIVE_FORMAT_PATH).decode() != pt2.ARCHIVE_FORMAT_VALUE:
            raise ValueError(f"{pt2.ARCHIVE_FORMAT_PATH} is not {pt2.ARCHIVE_FORMAT_VALUE!r}")
        legacy = "version" in zipfile.ZipFile(io.BytesIO(data)).namelist()
    except (RuntimeError, ValueError, zipfile.BadZipFile) as error:
        raise GemDataError(f"{where} is not a readable .pt2 archive (truncated or damaged: "
                           f"{first_sentence(error)}); export the run again"
                           ) from None
    if legacy:
        raise _refuse(where, "it is of the pre-2.8 torch.export format, whose loader unpickles")
    models = [r[len(pt2.MODELS_DIR):-len(".json")] for r in records
              if r.startswith(pt2.MODELS_DIR) and r.endswith(".json")]
    if not native and models != ["model"]:
        raise GemDataError(f"{where} holds programs {models}, not the one program 'model' "
                           "torch.export.save writes; export the run again")
    for record in records:
        if not native and record.startswith(pt2.AOTINDUCTOR_DIR):
            raise _refuse(where, f"{record} is a compiled library in a plain program")
        if record.startswith((pt2.WEIGHTS_DIR, pt2.CONSTANTS_DIR)) and record.endswith(".pt"):
            raise _refuse(where, f"{record} is a pickled payload (the legacy format)")
    for model in models:
        for config_name, dir_name in ((pt2.WEIGHTS_CONFIG_FILENAME_FORMAT, pt2.WEIGHTS_DIR),
                                      (pt2.CONSTANTS_CONFIG_FILENAME_FORMAT,
                                       pt2.CONSTANTS_DIR)):
            record = config_name.format(model)
            if record not in records:
                continue
            for entry, meta in _payload_config(reader, record, where).items():
                path_name = meta.get("path_name") if isinstance(meta, dict) else None
                if not isinstance(meta, dict) or meta.get("use_pickle") is not False:
                    raise _refuse(where, f"entry {entry!r} ({path_name}) of {record} is "
                                         "pickled (use_pickle)")
                prefix = (pt2.WEIGHT_FILENAME_PREFIX if dir_name == pt2.WEIGHTS_DIR
                          else pt2.TENSOR_CONSTANT_FILENAME_PREFIX)
                if not (isinstance(path_name, str) and path_name.startswith(prefix)):
                    raise _refuse(where, f"entry {entry!r} of {record} is {path_name!r}, not "
                                         "a tensor")
        if native:
            continue
        inputs = pt2.SAMPLE_INPUTS_FILENAME_FORMAT.format(model)
        if inputs in records:
            try:
                torch.load(io.BytesIO(reader.get_record(inputs)), weights_only=True)
            except Exception as error:  # noqa: BLE001 - anything the safe unpickler refuses
                raise _refuse(where, f"{inputs} is not plain tensors "
                                     f"({first_sentence(error)})") from None
        try:
            program = json.loads(reader.get_record(pt2.MODELS_FILENAME_FORMAT.format(model)))
            if not isinstance(program, dict) or not isinstance(program.get("guards_code", []),
                                                                list):
                raise ValueError("not an exported program")
            _check_program_json(program, where)
        except (RuntimeError, UnicodeDecodeError, ValueError, RecursionError) as error:
            if isinstance(error, GemDataError):
                raise
            raise GemDataError(f"{where}: models/{model}.json is unreadable ({error}); export "
                               "the run again") from None
