"""Errors the user can act on. The CLI prints their message without a traceback."""


class GemError(Exception):
    """Base of every error the GEM trainer raises on purpose."""


class GemConfigError(GemError, ValueError):
    """A configuration value, preset, override or backend name is not acceptable."""


class GemPluginError(GemError, RuntimeError):
    """A plugin is broken: it failed to import, registered a duplicate name, or cannot load."""


class GemDataError(GemError, ValueError):
    """Input data is malformed; the message names the file, row, feature and value."""


class GemRunError(GemError, RuntimeError):
    """A run cannot go on: its directory is in use or not writable, the disk is full, or the
    recovery from bad steps gave up. The message names the path or the reasons."""


class GemCheckpointError(GemError, RuntimeError):
    """A checkpoint cannot be used: damaged (a file differs from its recorded digest), of an older
    format, or asking to run code while it loads. The message names the files and the options."""
