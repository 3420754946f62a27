"""The options that choose a run's configuration, declared once for every command that takes
them: ``--preset``, ``--config`` and ``--set`` (see :func:`gem_core.config.load_config`)."""

from __future__ import annotations

from typing import Callable, TypeVar

import click

from gem_core.config import DEFAULT_PRESET

F = TypeVar("F", bound=Callable)

SET_HELP = "Override a key, e.g. --set train.steps=20 (repeatable)."


def config_options(*, preset: str | None = None, preset_help: str = "Preset name",
                   config_file: bool = True, overrides: bool = True,
                   overrides_name: str = "overrides", set_help: str = SET_HELP) -> Callable[[F], F]:
    """``--preset`` (parameter ``preset``), ``--config`` (``config_file``) and ``--set``
    (``overrides_name``, repeatable), in that order.

    ``preset``: the command's default preset; None leaves the choice to
    :func:`~gem_core.config.load_config` (``DEFAULT_PRESET``), and the help names it.
    ``preset_help``: what the preset is to this command, without the default.
    ``config_file`` and ``overrides``: whether the command takes ``--config`` and ``--set``.
    ``set_help``: the help of ``--set``, which differs by what the overrides apply to.
    """
    if preset is None:
        preset_option = click.option("--preset", default=None,
                                     help=f"{preset_help} (default: {DEFAULT_PRESET}).")
    else:
        preset_option = click.option("--preset", default=preset, show_default=True,
                                     help=f"{preset_help}.")
    options = [preset_option]
    if config_file:
        options.append(click.option("--config", "config_file", default=None,
                                    type=click.Path(dir_okay=False),
                                    help="A TOML config file instead of a preset."))
    if overrides:
        options.append(click.option("--set", overrides_name, multiple=True, metavar="KEY=VALUE",
                                    help=set_help))

    def decorate(command: F) -> F:
        for option in reversed(options):  # decorators apply bottom-up: keep the listed order
            command = option(command)
        return command

    return decorate
