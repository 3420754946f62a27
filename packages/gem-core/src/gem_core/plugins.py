"""The plugin manager: discovers plugins, fills one registry per kind, resolves ``auto``."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
from types import ModuleType
from typing import Any, Iterable, Mapping

import attrs
import pluggy

from gem_core import hookspecs
from gem_core.config import DataConfig
from gem_core.contracts import DataSource, check_contract
from gem_core.errors import GemConfigError, GemPluginError
from gem_core.kinds import kind_named
from gem_core.registry import KINDS, AutoContext, ImplementationSpec, PluginFailure, Registry

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "gem"
DISABLE_ENV = "GEM_DISABLE_PLUGINS"
BUILTIN_PLUGIN = "gem_core"


def disabled_plugins_from_env() -> frozenset[str]:
    """Plugin names listed in ``GEM_DISABLE_PLUGINS`` (comma separated)."""
    raw = os.environ.get(DISABLE_ENV, "")
    return frozenset(name.strip() for name in raw.split(",") if name.strip())


@attrs.frozen(kw_only=True)
class Resolved:
    """An implementation chosen for a run: its spec, the loaded object, why it was chosen and
    its options (an instance of the spec's options class, or None where it takes none)."""

    spec: ImplementationSpec
    impl: Any
    reason: str
    options: Any = None


class GemPlugins:
    """All registered implementations, by kind, plus the plugins that failed to import."""

    def __init__(
        self,
        manager: pluggy.PluginManager,
        failures: list[PluginFailure],
        distributions: dict[str, tuple[str, str]],
    ) -> None:
        self.manager = manager
        self.failures = failures
        self.distributions = distributions
        self.registries: dict[str, Registry] = {}
        for kind, (register_hook, _) in KINDS.items():
            registry = Registry(kind)
            registry.failures = list(failures)
            self._fill(registry, register_hook)
            self.registries[kind] = registry

    def _fill(self, registry: Registry, hook_name: str) -> None:
        hook = getattr(self.manager.hook, hook_name)
        # Call each implementation separately so every spec knows which plugin registered it.
        for impl in hook.get_hookimpls():
            distribution, version = self._distribution_of(impl.plugin_name)

            # The loop's values are bound as defaults: a plugin that keeps register() and
            # calls it later still records its own plugin, distribution and version.
            def register(spec: ImplementationSpec, _plugin: str = impl.plugin_name,
                         _distribution: str = distribution, _version: str = version) -> None:
                if not isinstance(spec, ImplementationSpec):
                    raise GemPluginError(
                        f"plugin {_plugin!r} passed {type(spec).__name__} to register() in "
                        f"{hook_name}; pass an ImplementationSpec"
                    )
                registry.add(
                    attrs.evolve(
                        spec,
                        kind=registry.kind,
                        plugin=_plugin,
                        distribution=_distribution,
                        version=_version,
                    )
                )

            impl.function(register=register)

    def _distribution_of(self, plugin_name: str) -> tuple[str, str]:
        return self.distributions.get(plugin_name, (plugin_name, ""))

    def registry(self, kind: str) -> Registry:
        try:
            return self.registries[kind]
        except KeyError:
            raise GemPluginError(f"unknown kind {kind!r}; kinds are {', '.join(KINDS)}") from None

    def default_answerers(self, kind: str) -> list[str]:
        """The plugins that answer ``auto`` for ``kind``, in the order they are asked (see
        :mod:`gem_core.hookspecs`): ``tryfirst`` implementations, then the others by plugin
        (entry-point) name, then ``trylast`` ones (gem-core's reference answers)."""
        return [impl.plugin_name for impl in self._ordered_default_impls(kind)]

    def _ordered_default_impls(self, kind: str) -> list[Any]:
        default_hook = kind_named(kind).default_hook
        if default_hook is None:
            raise GemConfigError(f"{kind} has no 'auto' choice; name one of "
                                 f"{', '.join(self.registry(kind).names())}")
        impls = getattr(self.manager.hook, default_hook).get_hookimpls()
        return sorted(impls, key=lambda impl: (0 if impl.tryfirst else 2 if impl.trylast else 1,
                                               impl.plugin_name))

    def default_for(self, kind: str, context: AutoContext) -> tuple[str, str]:
        """What ``auto`` means for ``kind`` in ``context``: ``(name, reason)``, the first answer
        in :meth:`default_answerers` order that is not None."""
        for impl in self._ordered_default_impls(kind):
            answer = impl.function(context=context)
            if answer is not None:
                name, reason = answer
                log.debug("%s: plugin %s answered auto with %r", kind, impl.plugin_name, name)
                return name, reason
        raise GemPluginError(f"no plugin answered {kind_named(kind).default_hook}; is "
                             "gem-core's plugin disabled?")

    def resolve(self, kind: str, name: str, context: AutoContext | None = None,
                options: Mapping[str, Any] | None = None) -> Resolved:
        """Load the implementation named ``name`` (or chosen for ``auto``) of ``kind``, with
        ``options`` (its kind's options table; None: empty) structured into the spec's options
        class, once, for everything the implementation is handed.

        An explicitly named implementation is loaded or the run fails: there is no fallback.
        With a ``context``, what the spec declares is enforced first: the run's device must be
        in its ``devices``, the run's activation dtype in its ``dtypes`` (precision recipes
        excepted: they set it) and a training run needs ``supports_backward``.
        """
        registry = self.registry(kind)
        if name == "auto":
            if context is None:
                raise GemConfigError(f"'auto' for {kind} needs a run context")
            chosen, why = self.default_for(kind, context)
            reason = f"auto: {why}"
            # DEBUG: a run logs every choice once, with its reason, in its start-up block.
            log.debug("%s: auto chose %r (%s)", kind, chosen, why)
        else:
            chosen, reason = name, "named in the configuration"
        spec = registry.get(chosen)
        if context is not None:
            check_declared(spec, context, chosen_by=reason)
        impl = registry.load(chosen)  # first: a missing requirement is named as such
        return Resolved(spec=spec, impl=impl, reason=reason,
                        options=spec.structure_options(options or {}))

    def data_source(self, config: DataConfig, *, seed: int) -> DataSource:
        """The data source ``config`` names, built with its ``[data.options]``."""
        return build_data_source(self.resolve("data", config.source, None, config.options),
                                 config, seed=seed)


def build_data_source(data: Resolved, config: DataConfig, *, seed: int) -> DataSource:
    """Call the resolved data factory with its options and check that it built a
    :class:`~gem_core.contracts.DataSource` (naming the plugin when not)."""
    source = data.impl(config, seed=seed, options=data.options)
    check_contract(source, DataSource, kind="data source", name=data.spec.name,
                   plugin=data.spec.plugin, distribution=data.spec.distribution)
    return source


def check_declared(spec: ImplementationSpec, context: AutoContext, *, chosen_by: str) -> None:
    """Refuse ``spec`` for a run in ``context`` when what it declares (devices, dtypes,
    backward) excludes it; the message names the implementation, its plugin and why."""
    what = f"{spec.kind} {spec.name!r}"
    origin = f" (from {spec.distribution or spec.plugin}; {chosen_by})"
    if context.device not in spec.devices:
        raise GemConfigError(f"{what} does not run on {context.device}; it supports "
                             f"{', '.join(spec.devices)}{origin}")
    if spec.kind != "precision" and context.dtype not in spec.dtypes:
        raise GemConfigError(
            f"{what} does not run under the precision recipe's activation dtype "
            f"{context.dtype}; it declares {', '.join(spec.dtypes)}{origin}; choose another "
            f"{spec.kind} or another precision recipe")
    if context.training and not spec.supports_backward:
        raise GemConfigError(f"{what} has no backward (supports_backward is false){origin}, "
                             "and this run trains; choose another for training")


def _version_of(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    return sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)


def build_plugins(
    *,
    extra_plugins: Iterable[tuple[str, ModuleType | object]] = (),
    disabled: Iterable[str] | None = None,
    load_entry_points: bool = True,
) -> GemPlugins:
    """Discover and register every plugin and fill the registries.

    ``extra_plugins`` are ``(name, module_or_object)`` pairs registered after the entry points
    (tests and embedding applications use this). ``disabled`` defaults to ``GEM_DISABLE_PLUGINS``.
    A plugin whose import fails is recorded, not raised: ``gem plugins`` shows it and a run that
    selects a name only it could provide fails with its import error in the message.
    """
    disabled_names = frozenset(disabled_plugins_from_env() if disabled is None else disabled)
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    failures: list[PluginFailure] = []
    distributions: dict[str, tuple[str, str]] = {}

    if BUILTIN_PLUGIN not in disabled_names:
        manager.register(importlib.import_module("gem_core.builtin_plugin"), name=BUILTIN_PLUGIN)
        distributions[BUILTIN_PLUGIN] = ("gem-core", _version_of("gem-core"))

    if load_entry_points:
        for entry_point in _entry_points():
            if entry_point.name in disabled_names or manager.get_plugin(entry_point.name):
                continue
            dist = entry_point.dist
            dist_name = dist.metadata["Name"] if dist is not None else entry_point.value
            try:
                plugin = entry_point.load()
            except Exception as error:  # any import-time failure of third-party code is reported
                failures.append(
                    PluginFailure(
                        plugin=entry_point.name,
                        distribution=dist_name,
                        error=f"{type(error).__name__}: {error}",
                    )
                )
                log.warning("plugin %s (%s) failed to import: %s", entry_point.name, dist_name,
                            error)
                continue
            manager.register(plugin, name=entry_point.name)
            distributions[entry_point.name] = (dist_name, dist.version if dist is not None else "")

    for name, plugin in extra_plugins:
        if name in disabled_names:
            continue
        manager.register(plugin, name=name)

    manager.check_pending()
    return GemPlugins(manager, failures, distributions)
