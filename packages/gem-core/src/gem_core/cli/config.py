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
@click.option("--sizes/--no-sizes", default=True, show_default=True,
              help="Append parameter count and FLOPs per sample as TOML comments.")
def show(preset: str | None, config_file: str | None, overrides: tuple[str, ...],
         sizes: bool) -> None:
    """Print the resolved configuration as TOML."""
    resolved = load_config(preset=preset, path=config_file, overrides=overrides)
    click.echo(to_toml(unstructure(resolved)), nl=False)
    if sizes:
        click.echo(_size_comments(resolved), nl=False)


def _size_comments(resolved) -> str:
    """Model size for this configuration, built on the meta device (no memory, no data read
    beyond the schema)."""
    from gem_core.errors import GemError
    from gem_core.model.summary import model_summary
    from gem_core.plugins import build_plugins

    try:
        factory = build_plugins().registry("data").load(resolved.data.source)
        schema = factory(resolved.data, seed=resolved.train.seed).schema
    except GemError as error:
        return f"\n# Model size not computed: the data schema is unavailable ({error})\n"
    summary = model_summary(resolved.model, schema)
    p = summary["parameters"]
    lines = ["", "# Model size (computed from this configuration; not a setting):",
             f"# parameters: {p['total']:,} ({p['embedding']:,} embedding, {p['dense']:,} dense)"]
    lines += [f"# training FLOPs per sample at history length {n}: {f:.4g}"
              for n, f in summary["train_flops_per_sample_by_history_length"].items()]
    return "\n".join(lines) + "\n"


@config.command("presets")
def presets() -> None:
    """List the presets shipped with gem-core."""
    for name in preset_names():
        click.echo(name)
