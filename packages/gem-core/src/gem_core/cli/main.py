"""``gem``: a click group whose sub-commands come from the ``cli`` registry.

Dotted names nest: a command registered as ``bench.attention`` is ``gem bench attention``; the
group ``bench`` exists implicitly when no plugin registers it. Listing commands (``gem --help``)
imports no command module, so no heavy library is imported either.
"""

from __future__ import annotations

from functools import cached_property

import click

from gem_core import __version__
from gem_core.errors import GemError
from gem_core.logs import configure_logging
from gem_core.plugins import GemPlugins, build_plugins
from gem_core.rank_exit import is_process_group_rank, run_then_exit


class _Catalog:
    """The CLI specs of the installed plugins, built once per process on first use."""

    @cached_property
    def plugins(self) -> GemPlugins:
        return build_plugins()

    def children(self, prefix: str) -> dict[str, str]:
        """Immediate sub-command names under ``prefix`` ('' for the top) and their help."""
        found: dict[str, str] = {}
        nested: dict[str, list[str]] = {}
        for spec in self.plugins.registry("cli").specs():
            if not spec.name.startswith(prefix):
                continue
            head, _, rest = spec.name[len(prefix):].partition(".")
            if rest:
                nested.setdefault(head, []).append(rest.split(".")[0])
            else:
                found[head] = spec.description
        for head, names in nested.items():
            found.setdefault(head, f"Commands from plugins: {', '.join(sorted(set(names)))}.")
        return found

    def command(self, full_name: str) -> click.Command | None:
        registry = self.plugins.registry("cli")
        if full_name in registry:
            command = registry.load(full_name)
            if not isinstance(command, click.Command):
                raise GemError(f"cli command {full_name!r} from {registry.get(full_name).plugin} "
                               f"loaded a {type(command).__name__}, not a click.Command")
            return command
        if any(name.startswith(full_name + ".") for name in registry.names()):
            return PluginGroup(name=full_name.split(".")[-1], prefix=full_name + ".",
                               help=f"{full_name} commands contributed by plugins.")
        return None


CATALOG = _Catalog()


class PluginGroup(click.Group):
    """A group whose commands are the ``cli`` specs under ``prefix``."""

    def __init__(self, *args, prefix: str = "", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prefix = prefix

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(CATALOG.children(self.prefix)))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        command = super().get_command(ctx, name)
        if command is not None:
            return command
        try:
            return CATALOG.command(self.prefix + name)
        except GemError as error:
            raise click.ClickException(str(error)) from error

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Help text from the specs, so that `gem --help` loads no command module.
        rows = sorted(CATALOG.children(self.prefix).items())
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except GemError as error:
            raise click.ClickException(str(error)) from error


@click.group(cls=PluginGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gem")
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]),
              help="Logging level of messages on stderr.")
@click.option("--log-format", default="text", show_default=True,
              type=click.Choice(["text", "json"]),
              help="One line per event: readable text, or one JSON object for machines.")
def cli(log_level: str, log_format: str) -> None:
    """GEM trainer: train generative ads recommendation models from plugins."""
    configure_logging(log_level, log_format)


def main() -> None:
    if is_process_group_rank():  # a rank skips interpreter finalization: see gem_core.rank_exit
        run_then_exit(lambda: cli(prog_name="gem"))
    cli(prog_name="gem")


if __name__ == "__main__":
    main()
