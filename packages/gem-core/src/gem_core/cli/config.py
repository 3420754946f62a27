"""``gem config``: presets and resolved configurations."""

from __future__ import annotations

import click

from gem_core.config import load_config, preset_names, to_toml, unstructure


@click.group("config")
def config() -> None:
    """Show presets and resolved configurations."""


@config.command("show")
@click.option("--preset", default=None, help="Preset name (default: tiny).")
@click.option("--config", "config_file", default=None, type=click.Path(dir_okay=False),
              help="A TOML config file instead of a preset.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a key, e.g. --set train.steps=20 (repeatable).")
def show(preset: str | None, config_file: str | None, overrides: tuple[str, ...]) -> None:
    """Print the resolved configuration as TOML."""
    resolved = load_config(preset=preset, path=config_file, overrides=overrides)
    click.echo(to_toml(unstructure(resolved)), nl=False)


@config.command("presets")
def presets() -> None:
    """List the presets shipped with gem-core."""
    for name in preset_names():
        click.echo(name)
