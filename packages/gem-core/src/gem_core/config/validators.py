"""Field validators whose messages read as one sentence once the key is put in front.

Each raises ValueError with a message that starts after the key, e.g. ``must be > 0, got -1``;
:func:`gem_core.config.loading.structure` prefixes the dotted key.
"""

from __future__ import annotations

from typing import Any, Iterable

import attrs


def _name(attribute: attrs.Attribute) -> str:
    return attribute.name


def choice(*allowed: str) -> Any:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value not in allowed:
            raise ValueError(f"{_name(attribute)} must be one of {', '.join(map(str, allowed))}; "
                             f"got {value!r}")
    check.allowed = allowed  # type: ignore[attr-defined]
    return check


def greater_than(bound: float) -> Any:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not value > bound:
            raise ValueError(f"{_name(attribute)} must be > {bound}; got {value!r}")
    return check


def at_least(bound: float) -> Any:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not value >= bound:
            raise ValueError(f"{_name(attribute)} must be >= {bound}; got {value!r}")
    return check


def between(low: float, high: float) -> Any:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not low <= value <= high:
            raise ValueError(f"{_name(attribute)} must be between {low} and {high}; got {value!r}")
    return check


def each(validator: Any) -> Any:
    def check(instance: Any, attribute: attrs.Attribute, value: Iterable[Any]) -> None:
        for item in value:
            validator(instance, attribute, item)
    return check
