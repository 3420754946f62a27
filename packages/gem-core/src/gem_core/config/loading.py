"""Turning presets, TOML files and ``--set`` overrides into a validated :class:`GemConfig`."""

from __future__ import annotations

import importlib.resources
import json
import logging
import math
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Iterable, TypeVar

import attrs

from gem_core.config.schema import GemConfig
from gem_core.config.written_before import as_written
from gem_core.errors import GemConfigError

T = TypeVar("T")

log = logging.getLogger(__name__)

DEFAULT_PRESET = "tiny"


def preset_names() -> list[str]:
    presets = importlib.resources.files("gem_core") / "presets"
    return sorted(p.name[: -len(".toml")] for p in presets.iterdir() if p.name.endswith(".toml"))


def read_preset(name: str) -> dict[str, Any]:
    names = preset_names()
    if name not in names:
        raise GemConfigError(f"unknown preset {name!r}; presets: {', '.join(names)}")
    text = (importlib.resources.files("gem_core") / "presets" / f"{name}.toml").read_text()
    return tomllib.loads(text)


def read_toml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise GemConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as error:
        raise GemConfigError(f"config file {path} is not valid TOML: {error}") from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"train.steps=20"`` -> ``(["train", "steps"], 20)``; values are TOML literals or strings."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise GemConfigError(f"--set {text!r}: expected dotted.key=value")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()  # a bare word such as softmax is a string
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    merged = json.loads(json.dumps(data))  # deep copy of plain TOML data
    for override in overrides:
        path, value = parse_override(override)
        node = merged
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise GemConfigError(f"--set {override!r}: {part} is a value, not a section")
            node = child
        node[path[-1]] = value
    return merged


def load_config(
    *, preset: str | None = None, path: str | Path | None = None, overrides: Iterable[str] = (),
    stored: bool = False,
) -> GemConfig:
    """A preset (default ``tiny``) or a TOML file, with overrides applied, validated.
    ``stored``: the file is one a run wrote (its ``config.toml``), whose missing keys mean what
    the version that wrote it did (:func:`gem_core.config.written_before.as_written`)."""
    if preset is not None and path is not None:
        raise GemConfigError("give either a preset or a config file, not both")
    if path is not None:
        data = read_toml(path)
        data = as_written(data) if stored else data
        data.setdefault("name", Path(path).stem)
    else:
        name = preset or DEFAULT_PRESET
        data = read_preset(name)
        data.setdefault("name", name)
    overrides = list(overrides)
    named = _named_data_keys(data if path is not None else {}, overrides)
    _drop_options_of_another_source(data, overrides)
    return structure(GemConfig, _mark_data_set_wins(apply_overrides(data, overrides), named))


#: ``[data]`` keys a file-backed data set has values of its own for (its manifest's
#: ``max_seq_len``, its eval split), which replace values the user did not choose.
DATA_SET_KEYS = ("max_seq_len", "eval_rows")


def _named_data_keys(user_file: dict[str, Any], overrides: list[str]) -> set[str]:
    """The keys of ``[data]`` the user chose: those of their own config file's ``[data]``
    (``user_file``; empty for a preset, whose values describe its generated data) and those
    ``--set`` names (``data.KEY=...``, or ``data={...}`` with the key in it)."""
    section = user_file.get("data")
    named = set(section) if isinstance(section, dict) else set()
    for override in overrides:
        path, value = parse_override(override)
        if path[:1] != ["data"]:
            continue
        if len(path) > 1:
            named.add(path[1])
        elif isinstance(value, dict):
            named |= set(value)
    return named


def _mark_data_set_wins(data: dict[str, Any], named: set[str]) -> dict[str, Any]:
    """``data.data_set_wins``: the :data:`DATA_SET_KEYS` with a value the user did not choose
    (a preset's, or ``max_seq_len``'s default), unless the user set the list themselves. An
    unset ``eval_rows`` already means the whole eval split: it is not listed, so that a run's
    ``config.toml`` (which leaves it out) reads back as the run's configuration."""
    if "data_set_wins" in named:
        return data
    section = data.setdefault("data", {})
    if not isinstance(section, dict):
        return data  # structure() names the bad value
    section["data_set_wins"] = [key for key in DATA_SET_KEYS if key not in named
                                and (key == "max_seq_len" or key in section)]
    return data


def _drop_options_of_another_source(data: dict[str, Any], overrides: list[str]) -> None:
    """``[data.options]`` belong to the source they were written for: when an override picks
    another source (``gem train --data NAME``), the base file's options are dropped, with one
    log line naming them (options set by overrides stay). Kept, they would fail the new
    source's validation or, worse, mean something else there (``num_items`` of ``synthetic``
    and of ``synthetic-ads`` have different defaults and effects)."""
    section = data.get("data")
    if not isinstance(section, dict):
        return
    for override in overrides:
        path, value = parse_override(override)
        base_source = section.get("source", "synthetic")
        if path == ["data", "source"] and value != base_source:
            dropped = section.pop("options", None)
            if dropped:
                log.info("data.source %s replaces %s of %s: its [data.options] (%s) are "
                         "dropped; set the new source's with --set data.options.KEY=VALUE",
                         value, base_source, data.get("name", "the configuration"),
                         ", ".join(f"{toml_key(k)} = {toml_literal(v)}"
                                   for k, v in dropped.items()))


def structure(cls: type[T], data: Any, path: str = "") -> T:
    """Build the attrs class ``cls`` from plain data, naming the dotted key of any problem."""
    where = path or "config"
    if not isinstance(data, dict):
        raise GemConfigError(f"{where} must be a table, got {data!r}")
    fields = {f.name: f for f in attrs.fields(attrs.resolve_types(cls))}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise GemConfigError(
            f"unknown key {_join(path, unknown[0])!r}; allowed keys"
            f"{' in ' + path if path else ''}: {', '.join(fields)}"
        )
    values = {}
    for name, value in data.items():
        field = fields[name]
        key = _join(path, name)
        value = _convert(field.type, value, key)
        if field.converter is not None:
            value = field.converter(value)
        if field.validator is not None:
            try:
                field.validator(None, field, value)
            except (ValueError, TypeError) as error:
                raise GemConfigError(_keyed(str(error), name, key)) from None
        values[name] = value
    try:
        return cls(**values)
    except (ValueError, TypeError) as error:  # cross-field checks in __attrs_post_init__
        raise GemConfigError(f"{where}: {error}") from None


def _keyed(message: str, name: str, key: str) -> str:
    return key + message[len(name):] if message.startswith(name) else f"{key}: {message}"


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _convert(annotation: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(annotation)
    if attrs.has(annotation):
        return structure(annotation, value, key)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, key)
            except GemConfigError as error:
                errors.append(str(error))
        raise GemConfigError(errors[0])
    if annotation is bool:
        if not isinstance(value, bool):
            raise GemConfigError(f"{key} must be true or false; got {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise GemConfigError(f"{key} must be an integer; got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise GemConfigError(f"{key} must be a number; got {value!r}")
        if not math.isfinite(float(value)):  # TOML reads inf, nan and 1e400 as floats
            raise GemConfigError(f"{key} must be a finite number; got {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise GemConfigError(f"{key} must be a string; got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise GemConfigError(f"{key} must be a list; got {value!r}")
        item_type = typing.get_args(annotation)[0]
        return tuple(_convert(item_type, item, f"{key}[{i}]") for i, item in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise GemConfigError(f"{key} must be a table; got {value!r}")
        return dict(value)
    return value


def unstructure(config: Any) -> dict[str, Any]:
    """Plain, JSON- and TOML-ready data (tuples become lists)."""
    return attrs.asdict(config)


def to_toml(data: dict[str, Any]) -> str:
    """A small TOML writer for configuration data: scalars, lists of scalars, nested tables."""
    lines: list[str] = []
    _write_table(data, [], lines)
    return "\n".join(lines).strip() + "\n"


def _write_table(table: dict[str, Any], path: list[str], lines: list[str]) -> None:
    # TOML has no null: an unset optional key (None) is left out, which reads back as unset.
    scalars = {k: v for k, v in table.items() if not isinstance(v, dict) and v is not None}
    tables = {k: v for k, v in table.items() if isinstance(v, dict)}
    if path and (scalars or not tables):
        lines.append(f"\n[{'.'.join(toml_key(part) for part in path)}]")
    for key, value in scalars.items():
        lines.append(f"{toml_key(key)} = {toml_literal(value)}")
    for key, value in tables.items():
        _write_table(value, [*path, key], lines)


# The escapes of TOML basic strings (https://toml.io/en/v1.0.0#string). Every other control
# character (U+0000 to U+001F and U+007F, which TOML forbids unescaped) and every character
# beyond ASCII is written as \uXXXX or \UXXXXXXXX: the output is plain ASCII, so a file written
# in any locale's encoding reads back the same. (json.dumps, which looks close, writes characters
# beyond U+FFFF as surrogate pairs, which TOML rejects, and leaves U+007F unescaped.)
_TOML_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n",
                 "\f": "\\f", "\r": "\\r"}


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string (double-quoted, escaped, ASCII only)."""
    out = []
    for char in text:
        code = ord(char)
        if char in _TOML_ESCAPES:
            out.append(_TOML_ESCAPES[char])
        elif 0x20 <= code < 0x7F:
            out.append(char)
        elif 0xD800 <= code <= 0xDFFF:  # a lone surrogate (undecodable bytes) is no character
            raise GemConfigError(f"cannot write {text!r} as TOML: it holds a lone surrogate")
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    return '"' + "".join(out) + '"'


def toml_key(key: str) -> str:
    """``key`` as a TOML key: bare where TOML allows it (ASCII letters, digits, ``_``, ``-``),
    else quoted."""
    bare = key and all(c.isascii() and (c.isalnum() or c in "_-") for c in key)
    return key if bare else toml_string(key)


def toml_literal(value: Any) -> str:
    """``value`` as a TOML literal (a dict as an inline table). The one TOML value writer of the
    project: gem-data's schema and ``[import]`` printers use it too."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        items = (f"{toml_key(k)} = {toml_literal(v)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    if value is None:
        raise GemConfigError("TOML has no null; leave the key out instead")
    raise GemConfigError(f"cannot write {value!r} as TOML")
