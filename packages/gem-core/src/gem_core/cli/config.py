"""``gem config``: presets, resolved configurations and what each key means."""

from __future__ import annotations

import json
import textwrap

import click

from gem_core.cli.options import config_options
from gem_core.config import load_config, to_toml, unstructure


@click.group("config")
def config() -> None:
    """Show presets, resolved configurations and what each key means."""


@config.command("show")
@config_options()
@click.option("--sizes/--no-sizes", default=True, show_default=True,
              help="Append parameter count and FLOPs per sample as TOML comments.")
@click.option("--applied", is_flag=True,
              help="Print the configuration as a run on this data records it in its "
                   "config.toml: the data set's own values applied and `\"schema\"` and "
                   "text settings resolved (model.action_feature, model.view_action); the "
                   "data must be there.")
def show(preset: str | None, config_file: str | None, overrides: tuple[str, ...],
         sizes: bool, applied: bool) -> None:
    """Print the resolved configuration as TOML, as given (`--applied`: as a run on this data
    records it). `gem config explain KEY` says what a key means."""
    resolved = load_config(preset=preset, path=config_file, overrides=overrides)
    applied_source = None
    if applied:  # the source is built once, for the configuration and the sizes
        applied_source, resolved = _applied(resolved)
    click.echo(to_toml(unstructure(resolved)), nl=False)
    if sizes:
        click.echo(_size_comments(resolved, applied_source), nl=False)


def _applied(resolved) -> tuple:
    """The data source of ``resolved`` and ``resolved`` as that source applies it (what a run
    records and builds its model from: e.g. a view action given as text looked up in the
    source's vocabulary); GemError when the source cannot be built here (a data set that is
    not there)."""
    from gem_core.plugins import build_plugins
    from gem_core.train.applied import config_as_source_applies

    source = build_plugins().data_source(resolved.data, seed=resolved.train.seed)
    return source, config_as_source_applies(resolved, source)


def _model_summary(resolved, source=None) -> dict:
    """:func:`gem_core.model.summary.model_summary` of this configuration, built on the meta
    device (no memory, no data read beyond the schema). ``source``: the data source
    ``resolved`` was already applied by, else built here (GemError when it cannot be)."""
    from gem_core.model.summary import model_summary

    if source is None:
        source, resolved = _applied(resolved)
    return model_summary(resolved.model, source.schema)


def _size_comments(resolved, source=None) -> str:
    """Model size for this configuration, as TOML comments; where it cannot be computed, why:
    the data's schema is unavailable, or the model refuses the options on that schema."""
    from gem_core.errors import GemError

    try:
        if source is None:
            source, resolved = _applied(resolved)
    except GemError as error:
        return f"\n# Model size not computed: the data schema is unavailable ({error})\n"
    try:
        summary = _model_summary(resolved, source)
    except GemError as error:
        return f"\n# Model size not computed: the model refuses these options ({error})\n"
    p = summary["parameters"]
    lines = ["", "# Model size (computed from this configuration; not a setting):",
             f"# parameters: {p['total']:,} ({p['embedding']:,} embedding, {p['dense']:,} dense)"]
    lines += [f"# training FLOPs per sample at history length {n}: {f:.4g}"
              for n, f in summary["train_flops_per_sample_by_history_length"].items()]
    return "\n".join(lines) + "\n"


@config.command("presets")
@click.option("--sizes", is_flag=True,
              help="Also print each preset's parameter count (builds each model on the meta "
                   "device: a few seconds).")
@click.option("--json", "as_json", is_flag=True, help="One JSON list instead of text.")
def presets(sizes: bool, as_json: bool) -> None:
    """List the presets shipped with gem-core, each with what it is for."""
    from gem_core.config.docs import preset_descriptions

    rows = [{"name": name, "description": text} for name, text in preset_descriptions().items()]
    if sizes:
        for row in rows:
            row["parameters"] = _parameter_count(load_config(preset=row["name"]))
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    width = max(len(row["name"]) for row in rows)
    for row in rows:
        size = ""
        if sizes:
            size = (" [parameters: data schema unavailable]" if row["parameters"] is None
                    else f" [{row['parameters']:,} parameters]")
        click.echo(f"{row['name']:<{width}}  {row['description']}{size}")


def _parameter_count(resolved) -> int | None:
    """The model's parameter count, or None when the data schema is unavailable."""
    from gem_core.errors import GemError

    try:
        return _model_summary(resolved)["parameters"]["total"]
    except GemError:
        return None


@config.command("explain")
@click.argument("keys", nargs=-1, metavar="[KEY]...")
@config_options()
@click.option("--json", "as_json", is_flag=True,
              help="One JSON list of sections and keys instead of text.")
def explain(keys: tuple[str, ...], preset: str | None, config_file: str | None,
            overrides: tuple[str, ...], as_json: bool) -> None:
    """What each configuration key means: type, default, allowed values and description.

    KEY is a section (train, model.moe) or a dotted key (train.steps); none: every key.
    The [backends] keys and data.source list what they accept: the names the installed
    plugins register (and auto, where the kind has an automatic choice). The options of the
    plugins the configuration chooses (--preset, --config, --set) are explained under their
    tables: data.options.KEY, precision.options.KEY, parallel.dense.KEY, parallel.embedding.KEY,
    parallel.activation_checkpointing.KEY.
    """
    from gem_core.config.docs import KeyDoc, config_docs
    from gem_core.config.docs import explain as explain_keys
    from gem_core.plugins import build_plugins

    plugins = build_plugins()
    resolved = load_config(preset=preset, path=config_file, overrides=overrides)
    entries = explain_keys(keys, _with_plugin_options(config_docs(), resolved, plugins))
    choices = _registered_choices(plugins)
    if as_json:
        rows = []
        for entry in entries:
            if isinstance(entry, KeyDoc):
                row = {"kind": "key", **entry.to_dict()}
                if entry.key in choices:
                    row["choices"] = choices[entry.key]
            else:
                row = {"kind": "section", "key": entry.key, "doc": entry.doc}
            rows.append(row)
        click.echo(json.dumps(rows, indent=2))
        return
    for entry in entries:
        if not isinstance(entry, KeyDoc):
            click.echo(f"\n[{entry.key}]")
            click.echo(textwrap.indent(entry.doc, "  # ", lambda line: True))
            continue
        facts = [entry.type] + ([entry.rule] if entry.rule else [])
        if entry.key in choices:
            facts.append(f"one of {', '.join(choices[entry.key])} (installed plugins)")
        click.echo(f"\n{entry.key} = {entry.default_toml}    ({'; '.join(facts)})")
        if entry.doc:
            click.echo(textwrap.indent(entry.doc, "    "))


def _with_plugin_options(entries, resolved, plugins) -> list:
    """``entries`` with, after each kind's options table (``parallel.dense``), the options of
    the implementation ``resolved`` chooses, from its spec's options class (``auto``: what it
    means on one CPU process)."""
    import attrs

    from gem_core.config.docs import describe_class
    from gem_core.kinds import KIND_TABLE
    from gem_core.registry import AutoContext

    tables = {kind.options_key: kind for kind in KIND_TABLE if kind.options_key}
    out = []
    for entry in entries:
        kind = tables.get(entry.key)
        if kind is None:
            out.append(entry)
            continue
        name = kind.chosen_in(resolved)
        if name == "auto":
            name, _ = plugins.default_for(kind.name, AutoContext(device="cpu"))
        spec = plugins.registry(kind.name).get(name)
        missing = spec.missing_requirements()
        options = None if missing else spec.options_class()
        takes = (f"The options of {kind.name} {name!r} (this configuration's), below."
                 if options is not None else
                 f"{kind.name} {name!r} (this configuration's) needs {', '.join(missing)}, "
                 "which is not installed." if missing else
                 f"{kind.name} {name!r} (this configuration's) takes no options.")
        out.append(attrs.evolve(entry, doc=f"{entry.doc}\n{takes}"))
        if options is not None:
            out += describe_class(options, entry.key)
    return out


def _registered_choices(plugins) -> dict[str, list[str]]:
    """What each key that names an implementation (``backends.attention``, ``data.source``)
    accepts: ``auto`` where its kind has a default hook, then the names the installed plugins
    register."""
    import attrs

    from gem_core.config import BackendsConfig
    from gem_core.registry import KINDS

    # Each [backends] key is named after the kind it chooses; the data source is data.source.
    keys = {f"backends.{field.name}": field.name for field in attrs.fields(BackendsConfig)}
    keys["data.source"] = "data"
    return {key: (["auto"] if KINDS[kind][1] is not None else [])
            + plugins.registry(kind).names() for key, kind in keys.items()}
