"""Checking an implementation against its kind's contract when a run loads it (the registry
calls :func:`check_contract`)."""

from __future__ import annotations

from typing import Any

from gem_core.errors import GemPluginError


def missing_methods(obj: Any, contract: type) -> list[str]:
    """The abstract methods of ``contract`` that ``obj`` (or its class) does not define: what to
    name when ``obj`` does not subclass ``contract``."""
    owner = obj if isinstance(obj, type) else type(obj)
    defined = {name for klass in owner.__mro__ for name, value in vars(klass).items()
               if callable(value)}
    return sorted(set(contract.__abstractmethods__) - defined)


def check_contract(obj: Any, contract: type | None, *, kind: str, name: str, plugin: str = "",
                   distribution: str = "") -> None:
    """Raise ``GemPluginError`` unless ``obj`` satisfies ``contract``: an instance of it (a
    class), or a callable (``None``: function-like kinds). The message names the
    implementation, its plugin and distribution, the kind and what is missing."""
    where = f"{kind} {name!r} (plugin {plugin or '?'}, distribution {distribution or '?'})"
    if contract is None:
        if not callable(obj):
            raise GemPluginError(f"{where} loaded a {type(obj).__name__}, which is not callable; "
                                 f"a {kind} is a function (see the hook's docstring)")
        return
    if isinstance(obj, contract):
        return
    missing = missing_methods(obj, contract)
    detail = (f"it lacks {', '.join(missing)}" if missing else
              "it has the methods but does not declare the contract")
    raise GemPluginError(
        f"{where} loaded a {type(obj).__name__}, which does not implement "
        f"{contract.__module__}.{contract.__qualname__}: {detail}; subclass "
        f"{contract.__qualname__} and implement its abstract methods")
