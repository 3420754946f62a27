"""``gem example``."""

import json

import click


@click.command("example")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def example(as_json: bool) -> None:
    """Show what the example plugin provides."""
    provides = {"attention": ["example-sdpa"], "cli": ["example"]}
    click.echo(json.dumps(provides) if as_json else
               "gem-example-plugin provides attention 'example-sdpa' and this command")
