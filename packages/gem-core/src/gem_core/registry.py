"""Registries of named implementations, one per kind, filled by the ``gem_register_*`` hooks."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Callable, Mapping

import attrs

from gem_core.config.loading import structure
from gem_core.config.validators import reject_options
from gem_core.contracts import check_contract
from gem_core.errors import GemConfigError, GemPluginError
from gem_core.kinds import KIND_TABLE, kind_named

#: Every kind of implementation, with the registration hook that fills it and, where ``auto`` is
#: allowed, the default hook that resolves it (derived from :data:`gem_core.kinds.KIND_TABLE`).
KINDS: dict[str, tuple[str, str | None]] = {
    kind.name: (kind.register_hook, kind.default_hook) for kind in KIND_TABLE
}


def _check_name(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    if not value or value == "auto" or not all(c.isalnum() or c in "-_." for c in value):
        raise ValueError(
            f"{attribute.name} must be a non-empty word of letters, digits, '-', '_' or '.' "
            f"other than 'auto', got {value!r}"
        )


@attrs.frozen(kw_only=True)
class ImplementationSpec:
    """One registered implementation of a kind: what it is called, what it can do, how to load
    it."""

    name: str = attrs.field(validator=_check_name)
    """Unique name within its kind; what users pass on the command line (``--attention triton``)."""

    load: Callable[[], Any]
    """Imports and returns the implementation. Called only when a run selects it."""

    description: str = ""
    """One line shown by ``gem plugins``."""

    devices: tuple[str, ...] = ("cpu", "cuda")
    """Device types it runs on; a run on another device refuses it at start-up."""

    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    """The activation dtypes (a precision recipe's :attr:`activation_dtype`) it runs under; a
    run whose recipe computes in another refuses it at start-up. Not used by precision recipes
    themselves."""

    supports_backward: bool = True
    """Whether gradients flow through it; a training run refuses one without."""

    activation_dtype: str = "float32"
    """Precision recipes only: the dtype the rest of the model computes in under this recipe
    (``bfloat16`` for bf16 autocast; ``float32`` for fp32 and for the FP8 recipes, whose FP8 is
    inside the converted linears). Every other implementation of the run must list it in its
    :attr:`dtypes`."""

    capabilities: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset)
    """What it supports, declared as data so a run checks its choices at start-up before
    building anything; the one source of who can do what, which every message naming the
    implementations able to do something reads. The names are those of
    :mod:`gem_core.capabilities` (:data:`~gem_core.capabilities.DECLARED_CAPABILITIES`):
    attention backends declare the normalisations they compute and their optional features
    (:data:`~gem_core.capabilities.ATTENTION_CAPABILITIES`); embedding backends, embedding
    shardings and data sources theirs."""

    requires: tuple[str, ...] = ()
    """Importable module names it needs; ``gem plugins`` checks them without importing them."""

    options: type | Callable[[], type] | None = None
    """The class of the options it takes, for kinds with an options table
    (:attr:`gem_core.kinds.Kind.options_key`: ``[parallel.dense]``, ``[data.options]`` ...), or a
    ``load``-like function returning it (:func:`lazy`, so that registering imports nothing
    heavy): a frozen, keyword-only attrs class with a default and a docstring under each field,
    its validators those of :mod:`gem_core.config.validators`. gem-core structures and validates
    the table into it once per run (an unknown key or a bad value is an error naming its full
    key, e.g. ``parallel.dense.foo``) and hands the instance to the implementation as
    ``options`` (``apply``, ``plan_estimate``, a data factory ...); ``gem config explain``
    describes its fields. None: it takes no options, refuses any, and is handed None."""

    kind: str = ""
    """Filled in by the registry from the hook that registered it."""

    plugin: str = ""
    """Filled in by the registry: the plugin (entry-point name) that registered it."""

    distribution: str = ""
    """Filled in by the registry: the installed distribution (package) of that plugin."""

    version: str = ""
    """Filled in by the registry: that distribution's version."""

    def options_class(self) -> type | None:
        """The class of :attr:`options` (loaded where it is a function); None: no options."""
        cls = self.options
        if cls is not None and not isinstance(cls, type):
            try:
                cls = cls()
            except ImportError as error:
                raise GemPluginError(
                    f"{self.kind} {self.name!r} from {self.distribution or self.plugin}: its "
                    f"options class failed to load: {error}") from error
        if cls is not None and not (isinstance(cls, type) and attrs.has(cls)):
            raise GemPluginError(f"{self.kind} {self.name!r} (plugin {self.plugin!r}) declares "
                                 f"options {cls!r}; declare an attrs class")
        return cls

    def structure_options(self, table: Mapping[str, Any]) -> Any:
        """``table`` (its kind's options table) as an instance of :attr:`options`, keys named
        under the kind's :attr:`~gem_core.kinds.Kind.options_key`; None where it takes no
        options (any key is then an error)."""
        cls = self.options_class()
        if cls is None:
            reject_options(f"{self.kind} {self.name!r}", table)
            return None
        return structure(cls, dict(table), kind_named(self.kind).options_key or "")

    def missing_requirements(self) -> list[str]:
        """Required modules that cannot be found, checked without importing them."""
        return [m for m in self.requires if importlib.util.find_spec(m) is None]


def lazy(module: str, attribute: str) -> Callable[[], Any]:
    """A ``load`` for a spec: imports ``module`` only when called and returns its ``attribute``
    (a command, a class, a function), so registering stays free of heavy imports."""

    def load() -> Any:
        return getattr(importlib.import_module(module), attribute)

    return load


@attrs.frozen(kw_only=True)
class AutoContext:
    """What the ``gem_default_*`` hooks may base their answer on."""

    device: str
    """Device type of this run: ``cpu`` or ``cuda``."""

    world_size: int = 1
    """Number of ranks in the run."""

    dtype: str = "float32"
    """The activation dtype of the run's precision recipe (its spec's ``activation_dtype``;
    resolved first). A default hook answers an implementation whose ``dtypes`` include it:
    ``resolve`` refuses any other, ``auto`` answers included."""

    training: bool = True
    """Whether the run trains (and so needs implementations that ``supports_backward``)."""

    compile: bool = False
    """Whether the run compiles its model (``train.compile``): its attention backend must then
    declare ``torch_compile``."""


@attrs.frozen(kw_only=True)
class PluginFailure:
    """A plugin whose module failed to import; fatal only if a run selects something it provides."""

    plugin: str
    distribution: str
    error: str


class Registry:
    """Named implementations of one kind. A duplicate name is an error; so is an unknown one."""

    def __init__(self, kind: str) -> None:
        self.contract = kind_named(kind).contract
        self.kind = kind
        self._specs: dict[str, ImplementationSpec] = {}
        self.failures: list[PluginFailure] = []

    def add(self, spec: ImplementationSpec) -> None:
        if not isinstance(spec, ImplementationSpec):
            raise GemPluginError(
                f"plugin {spec!r} registered a {type(spec).__name__} as a {self.kind}; "
                "register an ImplementationSpec"
            )
        self._check_options(spec)
        existing = self._specs.get(spec.name)
        if existing is not None:
            raise GemPluginError(
                f"duplicate {self.kind} name {spec.name!r}: registered by plugin "
                f"{existing.plugin!r} ({existing.distribution}) and by plugin {spec.plugin!r} "
                f"({spec.distribution}); rename one or disable a plugin with GEM_DISABLE_PLUGINS"
            )
        self._specs[spec.name] = spec

    def _check_options(self, spec: ImplementationSpec) -> None:
        if spec.options is None:
            return
        if kind_named(self.kind).options_key is None:
            raise GemPluginError(f"{self.kind} {spec.name!r} (plugin {spec.plugin!r}) declares "
                                 f"options, but {self.kind} implementations take none")
        if isinstance(spec.options, type):
            spec.options_class()  # an attrs class, or an error now
        elif not callable(spec.options):
            raise GemPluginError(f"{self.kind} {spec.name!r} (plugin {spec.plugin!r}) declares "
                                 f"options {spec.options!r}; declare an attrs class or a "
                                 "function returning one")

    def names(self) -> list[str]:
        return sorted(self._specs)

    def specs(self) -> list[ImplementationSpec]:
        return [self._specs[n] for n in self.names()]

    def __contains__(self, name: str) -> bool:
        return name in self._specs

    def get(self, name: str) -> ImplementationSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise GemConfigError(self._unknown_message(name)) from None

    def _unknown_message(self, name: str) -> str:
        message = (
            f"unknown {self.kind} implementation {name!r}; installed: "
            f"{', '.join(self.names()) or '(none)'}"
        )
        if self.failures:
            broken = "; ".join(f"{f.plugin} ({f.distribution}): {f.error}" for f in self.failures)
            message += f". Plugins that failed to import and may provide it: {broken}"
        return message

    def load(self, name: str) -> Any:
        """Load the named implementation; a missing requirement, an import error or an object
        that does not satisfy the kind's contract (:mod:`gem_core.contracts`) is fatal here."""
        spec = self.get(name)
        missing = spec.missing_requirements()
        if missing:
            raise GemPluginError(
                f"{self.kind} {name!r} from {spec.distribution or spec.plugin} needs "
                f"{', '.join(missing)}, which is not installed"
            )
        try:
            impl = spec.load()
        except ImportError as error:
            raise GemPluginError(
                f"{self.kind} {name!r} from {spec.distribution or spec.plugin} failed to load: "
                f"{error}"
            ) from error
        check_contract(impl, self.contract, kind=self.kind, name=name, plugin=spec.plugin,
                       distribution=spec.distribution)
        return impl
