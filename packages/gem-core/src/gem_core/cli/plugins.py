"""``gem plugins``: every registered implementation by kind, with its package, version and the
capabilities it declares."""

from __future__ import annotations

import json

import click

from gem_core.registry import KINDS


def plugin_table(plugins) -> dict:
    kinds = {}
    for kind in KINDS:
        rows = []
        for spec in plugins.registry(kind).specs():
            missing = spec.missing_requirements()
            rows.append({
                "name": spec.name, "package": spec.distribution, "version": spec.version,
                "plugin": spec.plugin, "description": spec.description,
                "devices": list(spec.devices), "dtypes": list(spec.dtypes),
                "supports_backward": spec.supports_backward,
                "capabilities": sorted(spec.capabilities),
                **({"activation_dtype": spec.activation_dtype} if kind == "precision" else {}),
                "status": "ok" if not missing else f"missing: {', '.join(missing)}",
            })
        kinds[kind] = rows
    failures = [{"plugin": f.plugin, "package": f.distribution, "error": f.error}
                for f in plugins.failures]
    return {"kinds": kinds, "failed_plugins": failures}


@click.command("plugins")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def plugins(as_json: bool) -> None:
    """List every registered implementation by kind, and plugins that failed to import."""
    from gem_core.cli.main import CATALOG

    table = plugin_table(CATALOG.plugins)
    if as_json:
        click.echo(json.dumps(table, indent=2))
        return
    for kind, rows in table["kinds"].items():
        click.echo(f"{kind}:")
        for row in rows:
            status = "" if row["status"] == "ok" else f"  [{row['status']}]"
            declares = (f"  (declares {', '.join(row['capabilities'])})"
                        if row["capabilities"] else "")
            click.echo(f"  {row['name']:<20} {row['package']} {row['version']}  "
                       f"{row['description']}{declares}{status}")
    if table["failed_plugins"]:
        click.echo("plugins that failed to import (fatal only if a run selects them):")
        for failure in table["failed_plugins"]:
            click.echo(f"  {failure['plugin']} ({failure['package']}): {failure['error']}")
