"""Capabilities have one source, the registrations: no message of the packages' sources names a
capability or lists implementations by hand.

Read from the source (``ast``): every string constant and the literal parts of every f-string
of ``packages/*/src``, docstrings excepted (they explain; they are not what a user is told). A
capability name in one (as a word: ``model.relative_bias``, a setting, is not the capability) must
come from :mod:`gem_core.capabilities` instead (``f"... {RELATIVE_BIAS} ..."``), and two or more
registered implementation names in a row (``"a, b or c"``) from the registry
(:func:`gem_core.capabilities.declared_by`). A string that *is* one name (a value compared or
passed, ``"softmax"``) is not a message. Implementation names are those of the kinds whose
implementations declare capabilities (attention, embedding, ...), read from the registry.
"""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: Strings that may name a capability or list implementations for another reason, by package
#: directory and a piece of the string, each with why. Every entry must still match (the list
#: only shrinks).
ALLOWED: dict[tuple[str, str], str] = {}

SEPARATORS = {",", "/", "or", "and", ", or", ", and"}


@lru_cache(maxsize=None)
def _registry():
    from gem_core.capabilities import DECLARED_CAPABILITIES
    from gem_core.plugins import build_plugins

    plugins = build_plugins()
    kinds = {kind: registry.specs() for kind, registry in plugins.registries.items()}
    names = frozenset(spec.name for specs in kinds.values()
                      if any(spec.capabilities for spec in specs) for spec in specs)
    declared = frozenset(c for specs in kinds.values() for spec in specs for c in spec.capabilities)
    return frozenset(DECLARED_CAPABILITIES), names, declared


def _word(names) -> re.Pattern:
    alternatives = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    return re.compile(rf"(?<![\w.\-])(?:{alternatives})(?![\w\-])")


def _sources() -> list[Path]:
    return sorted(p for p in REPO.glob("packages/*/src/**/*.py"))


def _message_strings(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, text)`` of every string that is not a docstring; an f-string's literal parts
    joined, with each replacement field as ``{}``."""
    docstrings, parts = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            docstrings.add(id(node.value))  # module, class, function and attribute docstrings
        if isinstance(node, ast.JoinedStr):
            parts.update(id(value) for value in node.values)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            found.append((node.lineno, text))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in docstrings and id(node) not in parts):
            found.append((node.lineno, node.value))
    return found


def _listed(text: str, names: frozenset[str]) -> list[str]:
    """Implementation names that stand in a list in ``text``: two in a row with only a
    separator (and quotes) between them."""
    matches = list(_word(names).finditer(text))
    listed = []
    for first, second in zip(matches, matches[1:]):
        between = text[first.end():second.start()].strip().strip("'\"`").strip()
        if between in SEPARATORS:
            listed += [first.group(), second.group()]
    return sorted(set(listed))


def test_every_declared_capability_is_a_name_of_gem_core_capabilities():
    capabilities, _, declared = _registry()
    assert declared <= capabilities, (
        f"registered implementations declare {sorted(declared - capabilities)}, which "
        "gem_core.capabilities does not define: add each there, with what it means")


def test_no_message_names_a_capability_or_lists_implementations_by_hand():
    capabilities, names, _ = _registry()
    capability_word = _word(capabilities)
    wrong, allowed_seen = [], set()
    for path in _sources():
        relative = str(path.relative_to(REPO))
        for line, text in _message_strings(ast.parse(path.read_text(), relative)):
            if text.strip() in capabilities | names:
                continue  # a value, not a message
            named = sorted(set(capability_word.findall(text)))
            listed = _listed(text, names)
            if not (named or listed):
                continue
            allowed = [key for key in ALLOWED
                       if relative.startswith(key[0]) and key[1] in text]
            if allowed:
                allowed_seen.update(allowed)
                continue
            what = "; ".join(filter(None, (
                named and f"capability {', '.join(named)} (use gem_core.capabilities' constant)",
                listed and f"implementations {', '.join(listed)} listed by hand "
                           "(build the list from the registry: capabilities.declared_by)")))
            wrong.append(f"{relative}:{line}: {what}: {text[:100]!r}")
    assert not wrong, "messages written by hand:\n" + "\n".join(wrong)
    stale = sorted(set(ALLOWED) - allowed_seen)
    assert not stale, f"ALLOWED entries that match nothing any more (remove them): {stale}"


def test_capability_names_are_imported_from_gem_core_capabilities_only():
    from gem_core import capabilities

    constants = {name for name, value in vars(capabilities).items()
                 if name.isupper() and not name.startswith("_")}
    wrong = []
    for path in _sources():
        relative = str(path.relative_to(REPO))
        for node in ast.walk(ast.parse(path.read_text(), relative)):
            if not isinstance(node, ast.ImportFrom) or node.module == "gem_core.capabilities":
                continue
            imported = sorted({alias.name for alias in node.names} & constants)
            if not imported or node.level:
                continue
            wrong.append(f"{relative}:{node.lineno} imports {', '.join(imported)} from "
                         f"{node.module}")
    assert not wrong, ("capability names imported from elsewhere than gem_core.capabilities:\n"
                       + "\n".join(wrong))
