"""GEM trainer core: plugins, configs, jagged batches, the GEM model, trainer, metrics and CLI."""

from importlib.metadata import PackageNotFoundError, version

import pluggy

from gem_core.hookspecs import PROJECT_NAME

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""Decorator for plugin hook implementations: ``@gem_core.hookimpl``."""

try:
    __version__ = version("gem-core")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"

__all__ = ["hookimpl", "__version__"]
