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
from gem_core.logs import FORMATS, LEVELS, configure_logging, current_logging
from gem_core.plugins import GemPlugins, build_plugins
from gem_core.rank_exit import is_process_group_rank, run_then_exit
from gem_core.stack_dump import enable_stack_dumps


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
            return with_logging_options(command)
        if any(name.startswith(full_name + ".") for name in registry.names()):
            return with_logging_options(PluginGroup(
                name=full_name.split(".")[-1], prefix=full_name + ".",
                help=f"{full_name} commands contributed by plugins."))
        return None


CATALOG = _Catalog()


def _set_log_level(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is not None:
        configure_logging(value, current_logging()[1])


def _set_log_format(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is not None:
        configure_logging(current_logging()[0], value)


def logging_options() -> list[click.Option]:
    """``--log-level`` and ``--log-format`` for a sub-command: the same as ``gem``'s own, so
    that ``gem train --log-level WARNING`` works as well as ``gem --log-level WARNING train``
    (given after the sub-command, they win)."""
    return [
        click.Option(["--log-level"], type=click.Choice(LEVELS), default=None,
                     expose_value=False, callback=_set_log_level,
                     help="Logging level of messages on stderr (as gem --log-level)."),
        click.Option(["--log-format"], type=click.Choice(FORMATS), default=None,
                     expose_value=False, callback=_set_log_format,
                     help="text or json log lines (as gem --log-format)."),
    ]


def with_logging_options(command: click.Command) -> click.Command:
    """Add :func:`logging_options` to ``command`` and, for a group, to every command in it
    (once; an option of the same name the command already has is kept)."""
    names = {param.name for param in command.params}
    command.params += [option for option in logging_options() if option.name not in names]
    if isinstance(command, click.Group) and not isinstance(command, PluginGroup):
        for sub in command.commands.values():
            with_logging_options(sub)
    return command


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
@click.option("--log-level", default="INFO", show_default=True, type=click.Choice(LEVELS),
              help="Logging level of messages on stderr (every sub-command also takes it). In "
                   "a process group, ranks other than 0 print only warnings and errors.")
@click.option("--log-format", default="text", show_default=True, type=click.Choice(FORMATS),
              help="One line per event: readable text, or one JSON object for machines.")
def cli(log_level: str, log_format: str) -> None:
    """GEM trainer: train generative ads recommendation models from plugins."""
    configure_logging(log_level, log_format)


def main() -> None:
    enable_stack_dumps()  # kill -USR1 PID: every thread's stack on stderr (a hung run says where)
    if is_process_group_rank():  # a rank skips interpreter finalization: see gem_core.rank_exit
        run_then_exit(lambda: cli(prog_name="gem"))
    cli(prog_name="gem")


if __name__ == "__main__":
    main()
