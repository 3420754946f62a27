"""gem-data's plugin module, named by its `gem` entry point. Registration only: no heavy imports."""

from __future__ import annotations

from gem_core import hookimpl
from gem_core.registry import ImplementationSpec
