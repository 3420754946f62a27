"""What every configuration key means, read from the attrs classes that define it.

Python keeps no docstring of a class attribute at runtime; the string literal under each field
of :mod:`gem_core.config.schema` and :mod:`gem_core.config.model_schema` is read once from the
class's source with :mod:`ast` (cached) and paired with the field's type, default and validator
rule. ``gem config explain`` prints these, and any plugin's options class (an attrs class
written the same way) can be described by :func:`describe_class`.

Presets are described by the first line of their leading comment block (``# ...`` lines before
the first key), the one place a preset says what it is for.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.resources
import inspect
import textwrap
import types
import typing
from typing import Any

import attrs

from gem_core.config.loading import preset_names, read_preset, toml_literal
from gem_core.config.schema import GemConfig
from gem_core.config.validators import Rule
from gem_core.errors import GemConfigError

_IN_VALIDATOR = type(attrs.validators.in_(()))
_INSTANCE_OF_VALIDATOR = type(attrs.validators.instance_of(int))


@attrs.frozen(kw_only=True)
class KeyDoc:
    """One configuration key."""

    key: str
    """Dotted key, e.g. ``train.steps``."""

    type: str
    """What the TOML value is: ``integer``, ``number``, ``string``, ``boolean``, ``list of
    integer``, ``table``."""

    default: Any
    """The default, as plain data (a list for a tuple)."""

    rule: str
    """What the validator allows (``> 0``, ``one of softmax, silu``); empty when any value of
    the type goes."""

    allowed: tuple[Any, ...] | None
    """The allowed values where the rule is a list of them."""

    doc: str
    """The field's docstring."""

    @property
    def default_toml(self) -> str:
        """The default as a TOML literal (``(not set)`` for None, which TOML cannot write: the
        key is left out)."""
        return "(not set)" if self.default is None else toml_literal(self.default)

    def to_dict(self) -> dict[str, Any]:
        data = attrs.asdict(self)
        data["allowed"] = list(self.allowed) if self.allowed is not None else None
        return data


@attrs.frozen(kw_only=True)
class SectionDoc:
    """One TOML table of the configuration (``train``, ``model.moe``)."""

    key: str
    """Dotted name of the table."""

    doc: str
    """The section's docstring: the field's own where it has one, else its class's."""


@functools.cache
def field_docstrings(cls: type) -> dict[str, str]:
    """``{field name: docstring}`` of an attrs class, from the string literals that follow its
    fields in the class source (base classes' fields included, the subclass winning)."""
    found: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if not attrs.has(base):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(base)))
        body = tree.body[0].body  # the ClassDef
        for statement, following in zip(body, body[1:]):
            if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                    and isinstance(following, ast.Expr)
                    and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                found[statement.target.id] = inspect.cleandoc(following.value.value)
    return found


def describe_class(cls: type, prefix: str = "") -> list[SectionDoc | KeyDoc]:
    """The keys of attrs class ``cls`` dotted under ``prefix``, then each nested class as a
    section followed by its own keys."""
    keys: list[SectionDoc | KeyDoc] = []
    nested: list[SectionDoc | KeyDoc] = []
    docs = field_docstrings(cls)
    for field in attrs.fields(attrs.resolve_types(cls)):
        key = f"{prefix}.{field.name}" if prefix else field.name
        if attrs.has(field.type):
            own = docs.get(field.name) or inspect.cleandoc(field.type.__doc__ or "")
            nested.append(SectionDoc(key=key, doc=own))
            nested += describe_class(field.type, key)
            continue
        rule, allowed = _rule_of(field.validator)
        keys.append(KeyDoc(key=key, type=_type_name(field.type), default=_default_of(field),
                           rule=rule, allowed=allowed, doc=docs.get(field.name, "")))
    return keys + nested


@functools.cache
def config_docs() -> tuple[SectionDoc | KeyDoc, ...]:
    """Every key and section of :class:`GemConfig`, each section followed by its keys."""
    return tuple(describe_class(GemConfig))


def explain(selectors: typing.Iterable[str] = (),
            entries: typing.Sequence[SectionDoc | KeyDoc] | None = None
            ) -> list[SectionDoc | KeyDoc]:
    """The sections and keys that ``selectors`` name, in schema order: a section (``train``,
    ``model.moe``) or a table (``parallel.dense``) brings itself and everything under it, a key
    itself; none: everything. ``entries``: what to choose from (default :func:`config_docs`;
    ``gem config explain`` adds the options of the configured plugins). An unknown name is an
    error that lists the keys of its table, or else the closest known names."""
    entries = config_docs() if entries is None else entries
    selectors = [s.strip() for s in selectors]
    if not selectors:
        return list(entries)
    known = [entry.key for entry in entries]
    for selector in selectors:
        # Under a plugin's options table (``parallel.dense``, a key of type table): its keys.
        table = selector.rpartition(".")[0]
        if selector not in known and any(isinstance(e, KeyDoc) and e.key == table
                                         for e in entries):
            options = [k for k in known if k.rpartition(".")[0] == table]
            raise GemConfigError(f"unknown configuration key {selector!r}; the keys of {table}: "
                                 f"{', '.join(options) or '(none)'}")
        if selector not in known:
            close = difflib.get_close_matches(selector, known, n=5, cutoff=0.6)
            # A bare field name (``steps``) is close to its dotted key (``train.steps``).
            close += [k for k in known if k.rsplit(".", 1)[-1] == selector and k not in close]
            sections = [e.key for e in entries if isinstance(e, SectionDoc) and "." not in e.key]
            hint = (f"; did you mean {', '.join(close)}?" if close
                    else f"; sections: {', '.join(sections)}")
            raise GemConfigError(f"unknown configuration key {selector!r}{hint}")
    return [entry for entry in entries
            if any(entry.key == s or entry.key.startswith(s + ".") for s in selectors)]


def _rule_of(validator: Any) -> tuple[str, tuple[Any, ...] | None]:
    if validator is None:
        return "", None
    if isinstance(validator, Rule):
        return validator.rule, validator.allowed
    if isinstance(validator, _INSTANCE_OF_VALIDATOR):  # the type says it
        return "", None
    if isinstance(validator, _IN_VALIDATOR):
        allowed = tuple(validator.options)
        return "one of " + ", ".join(map(str, allowed)), allowed
    raise GemConfigError(f"cannot describe validator {validator!r}: use one of "
                         "gem_core.config.validators")


_TYPE_NAMES = {int: "integer", float: "number", str: "string", bool: "boolean"}


def _type_name(annotation: Any) -> str:
    if annotation in _TYPE_NAMES:
        return _TYPE_NAMES[annotation]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is tuple:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return "table" if args[1] is Any else f"table of {_type_name(args[1])}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join("none" if a is type(None) else _type_name(a) for a in args)
    if annotation is Any:
        return "any"
    return annotation.__name__ if isinstance(annotation, type) else str(annotation)


def _default_of(field: attrs.Attribute) -> Any:
    default = field.default
    if isinstance(default, attrs.Factory):
        default = default.factory()
    if default is attrs.NOTHING:
        raise GemConfigError(f"configuration field {field.name!r} has no default: every key "
                             "needs one so that a preset may leave it out")
    if field.converter is not None:
        default = field.converter(default)
    return list(default) if isinstance(default, tuple) else default


# -- presets ----------------------------------------------------------------------------------


def preset_description(name: str) -> str:
    """The first sentence of the preset's leading comment block (the ``#`` lines before the
    first key); an error if it has none, so that every shipped preset says what it is for."""
    read_preset(name)  # an unknown name is an error listing the presets
    text = (importlib.resources.files("gem_core") / "presets" / f"{name}.toml").read_text()
    comment: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped.startswith("#"):
            break
        comment.append(stripped.lstrip("#").strip())
    block = " ".join(part for part in comment if part)
    if not block:
        raise GemConfigError(f"preset {name!r} has no leading '# description' comment")
    sentence, dot, _ = block.partition(". ")
    return sentence + dot.strip()


def preset_descriptions() -> dict[str, str]:
    return {name: preset_description(name) for name in preset_names()}
