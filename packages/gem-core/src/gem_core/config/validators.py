"""Field validators whose messages read as one sentence once the key is put in front.

Each raises ValueError with a message that starts after the key, e.g. ``must be > 0, got -1``;
:func:`gem_core.config.loading.structure` prefixes the dotted key. Each validator is a small
frozen class whose ``rule`` states what it allows, so ``gem config explain`` prints the same
rule the validator enforces (one definition of each rule).
"""

from __future__ import annotations

import abc
from typing import Any, Iterable, Mapping

import attrs

from gem_core.errors import GemConfigError


def _name(attribute: attrs.Attribute) -> str:
    return attribute.name


class Rule(abc.ABC):
    """A validator that can say what it allows."""

    @abc.abstractmethod
    def __call__(self, instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        """Raise ValueError naming ``attribute`` when ``value`` breaks the rule."""

    @property
    @abc.abstractmethod
    def rule(self) -> str:
        """What the validator allows, e.g. ``> 0`` or ``one of softmax, silu``."""

    @property
    def allowed(self) -> tuple[Any, ...] | None:
        """The values allowed, where the rule is a list of them; None otherwise."""
        return None


@attrs.frozen
class Choice(Rule):
    options: tuple[Any, ...]

    def __call__(self, instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value not in self.options:
            raise ValueError(f"{_name(attribute)} must be one of "
                             f"{', '.join(map(str, self.options))}; got {value!r}")

    @property
    def rule(self) -> str:
        return "one of " + ", ".join(map(str, self.options))

    @property
    def allowed(self) -> tuple[Any, ...]:
        return self.options


@attrs.frozen
class GreaterThan(Rule):
    bound: float

    def __call__(self, instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not value > self.bound:
            raise ValueError(f"{_name(attribute)} must be > {self.bound}; got {value!r}")

    @property
    def rule(self) -> str:
        return f"> {self.bound}"


@attrs.frozen
class AtLeast(Rule):
    bound: float

    def __call__(self, instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not value >= self.bound:
            raise ValueError(f"{_name(attribute)} must be >= {self.bound}; got {value!r}")

    @property
    def rule(self) -> str:
        return f">= {self.bound}"


@attrs.frozen
class Between(Rule):
    low: float
    high: float

    def __call__(self, instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not self.low <= value <= self.high:
            raise ValueError(f"{_name(attribute)} must be between {self.low} and {self.high}; "
                             f"got {value!r}")

    @property
    def rule(self) -> str:
        return f"between {self.low} and {self.high}"


@attrs.frozen
class Each(Rule):
    item: Rule

    def __call__(self, instance: Any, attribute: attrs.Attribute, value: Iterable[Any]) -> None:
        for item in value:
            self.item(instance, attribute, item)

    @property
    def rule(self) -> str:
        return f"each {self.item.rule}"

    @property
    def allowed(self) -> tuple[Any, ...] | None:
        return self.item.allowed


def choice(*allowed: Any) -> Choice:
    return Choice(tuple(allowed))


def greater_than(bound: float) -> GreaterThan:
    return GreaterThan(bound)


def at_least(bound: float) -> AtLeast:
    return AtLeast(bound)


def between(low: float, high: float) -> Between:
    return Between(low, high)


def each(validator: Rule) -> Each:
    return Each(validator)


@attrs.frozen
class OrNone(Rule):
    """``item``'s rule, or no value (None)."""

    item: Rule

    def __call__(self, instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None:
            self.item(instance, attribute, value)

    @property
    def rule(self) -> str:
        return f"{self.item.rule}, or none"


def optional(validator: Rule) -> OrNone:
    return OrNone(validator)


def reject_options(owner: str, options: Mapping[str, Any]) -> None:
    """For implementations that take no options: any option is a mistake worth an error."""
    if options:
        raise GemConfigError(f"{owner} takes no options; got {', '.join(sorted(options))}")
