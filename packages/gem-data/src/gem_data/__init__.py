"""gem-data: see README.md."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("gem-data")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"
