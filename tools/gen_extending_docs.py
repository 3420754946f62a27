"""Rewrite the generated regions of docs/extending.md from the code: the table of kinds
(gem_core.kinds), each kind's contract (the abstract base classes of gem_core.contracts and the
classes they hand over, read from their source), the capabilities, the order of ``auto`` answers
and the implementations the trainer's own packages register.

A region is the text between ``<!-- generated: NAME -->`` and ``<!-- end generated -->``; the
prose around it is written by hand. Every region the page has must be one this tool knows, and
every region it knows must be on the page.

Usage: python tools/gen_extending_docs.py [--check]   (--check: fail if the page is out of date)
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
import tomllib
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "extending.md"

REGION = re.compile(
    r"(<!-- generated: (?P<name>[\w:-]+) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.DOTALL)

# Which classes a writer of each kind reads, beyond the kind's own contract: what its methods
# receive or return. (module, class) pairs; a dataclass-like class (attrs) is shown as fields.
READS: dict[str, tuple[tuple[str, str], ...]] = {
    "attention": (("gem_core.attention.api", "AttentionParams"),),
    "norm": (),
    "embedding": (("gem_core.embedding_tables", "EmbeddingTableConfig"),),
    "model": (("gem_core.contracts", "RankingModel"),
              ("gem_core.contracts", "StrategyModel")),
    "dense_sharding": (("gem_core.engine", "Engine"), ("gem_core.distributed", "ParallelContext")),
    "embedding_sharding": (("gem_core.contracts", "ShardedModule"),
                           ("gem_core.contracts", "LearningRateFollower"),
                           ("gem_core.contracts", "StepRunner")),
    "precision": (),
    "activation_checkpointing": (),
    "balancer": (),
    "data": (("gem_core.contracts", "DataSource"), ("gem_core.contracts", "TrainStream"),
             ("gem_core.config.schema", "DataConfig")),
    "cli": (),
}

# Where the capability names are defined (the one module that exports them): module-level string
# constants with a docstring (or a ``#:`` comment) that says what declaring them means.
CAPABILITY_MODULE = "gem_core.capabilities"


# ---------------------------------------------------------------------------------------------
# Reading docstrings and signatures from the source.
# ---------------------------------------------------------------------------------------------


def prose(doc: str | None) -> str:
    """A docstring as one Markdown paragraph: reST literals and roles become code spans."""
    if not doc:
        return ""
    text = " ".join(inspect.cleandoc(doc).split())
    text = re.sub(r":(?:class|func|meth|mod|data|attr):`~?([^`]+)`", r"``\1``", text)
    return text.replace("``", "`")


def _class_node(module_name: str, class_name: str) -> ast.ClassDef:
    module = importlib.import_module(module_name)
    files = [Path(inspect.getfile(module))]
    if hasattr(module, "__path__"):
        # A package that exports its submodules' classes under its own name (gem_core.contracts)
        # defines them in those submodules: read them too.
        files += sorted(p for p in files[0].parent.glob("*.py") if p != files[0])
    for path in files:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and node.name == class_name:
                return node
    raise LookupError(f"{module_name} has no class {class_name}")


def _is_abstract(node: ast.FunctionDef) -> bool:
    return any(ast.unparse(d).endswith("abstractmethod") for d in node.decorator_list)


def _signature(node: ast.FunctionDef) -> str:
    args = node.args
    args_without_self = ast.arguments(
        posonlyargs=args.posonlyargs, args=args.args[1:] if args.args else [],
        vararg=args.vararg, kwonlyargs=args.kwonlyargs, kw_defaults=args.kw_defaults,
        kwarg=args.kwarg, defaults=args.defaults)
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    return f"{node.name}({ast.unparse(args_without_self)}){returns}"


def _attribute_docs(node: ast.ClassDef) -> list[tuple[str, str, str | None, str]]:
    """``(name, annotation, default or None, docstring)`` of each annotated class attribute."""
    out = []
    body = node.body
    for index, item in enumerate(body):
        if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
            continue
        following = body[index + 1] if index + 1 < len(body) else None
        doc = (following.value.value if isinstance(following, ast.Expr)
               and isinstance(following.value, ast.Constant)
               and isinstance(following.value.value, str) else "")
        out.append((item.target.id, ast.unparse(item.annotation), _default(item.value), doc))
    return out


def _default(value: ast.expr | None) -> str | None:
    if value is None:
        return None
    if isinstance(value, ast.Call) and ast.unparse(value.func) in ("attrs.Factory", "Factory"):
        return "(computed)"  # e.g. from another field; the docstring says how
    if isinstance(value, ast.Call) and ast.unparse(value.func) in ("attrs.field", "field"):
        for keyword in value.keywords:
            if keyword.arg == "default":
                return _default(keyword.value)
            if keyword.arg == "factory":
                return f"{ast.unparse(keyword.value)}()"
        return None
    return ast.unparse(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_class(module_name: str, class_name: str) -> str:
    """A class as Markdown: its docstring, then its attributes and methods, each marked
    required (abstract) or with a default."""
    node = _class_node(module_name, class_name)
    lines = [f"**`{class_name}`** (`{module_name}`): {prose(ast.get_docstring(node))}", ""]
    is_attrs = any("attrs." in ast.unparse(d) for d in node.decorator_list)
    attributes = _attribute_docs(node)
    if is_attrs:
        lines += ["| field | type | default | meaning |", "|---|---|---|---|"]
        for name, annotation, default, doc in attributes:
            shown = ("(required)" if default is None else default if default == "(computed)"
                     else f"`{_cell(default)}`")
            lines.append(f"| `{name}` | `{_cell(annotation)}` | {shown} | {_cell(prose(doc))} |")
        lines.append("")
    else:
        for name, annotation, default, doc in attributes:
            value = "" if default is None else f" = {default}"
            lines.append(f"- attribute `{name}: {annotation}{value}`" + (f": {prose(doc)}" if doc
                                                                          else ""))
    for item in node.body:
        if not isinstance(item, ast.FunctionDef):
            continue
        if (item.name.startswith("_") and not item.name.endswith("__")
                or item.name.startswith("__attrs_")):
            continue  # private helpers; dunders (__call__, __next__, __init__) are the API
        doc = prose(ast.get_docstring(item))
        decorators = {ast.unparse(d) for d in item.decorator_list}
        if "property" in decorators:
            shown = f"property `{item.name}: {ast.unparse(item.returns)}`"
        elif is_attrs:  # a value handed to implementations, not a part they provide
            shown = f"method `{_signature(item)}`"
        else:
            shown = f"{'**required**' if _is_abstract(item) else 'default'} `{_signature(item)}`"
        lines.append(f"- {shown}" + (f": {doc}" if doc else ""))
    return "\n".join(lines).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------
# The regions.
# ---------------------------------------------------------------------------------------------


def _code(text: str | None) -> str:
    return f"`{text}`" if text else "-"


def render_kinds() -> str:
    from gem_core.kinds import KIND_TABLE

    lines = ["| kind | what it does | registration hook | `auto` hook | config key | `gem train` "
             "flag | `load()` returns |", "|---|---|---|---|---|---|---|"]
    for kind in KIND_TABLE:
        returns = kind.returns
        if kind.contract is not None:
            returns = f"{returns} (`{kind.contract.__module__}.{kind.contract.__qualname__}`)"
        lines.append(f"| `{kind.name}` | {kind.description} | `{kind.register_hook}` | "
                     f"{_code(kind.default_hook)} | {_code(kind.config_key)} | "
                     f"{_code(kind.cli_flag)} | {_cell(returns)} |")
    return "\n".join(lines) + "\n"


def render_contract(kind_name: str) -> str:
    from gem_core.kinds import kind_named

    kind = kind_named(kind_name)
    parts = []
    if kind.contract is not None:
        parts.append(render_class(kind.contract.__module__, kind.contract.__qualname__))
    else:
        parts.append(f"`load()` returns {kind.returns}.\n")
    for module_name, class_name in READS[kind_name]:
        parts.append(render_class(module_name, class_name))
    return "\n".join(parts)


def _repository_distributions() -> frozenset[str]:
    """The distributions of this repository's packages: the page lists only what ships with
    the trainer, whatever else the environment has installed."""
    names = set()
    for pyproject in sorted((REPO / "packages").glob("*/pyproject.toml")):
        names.add(tomllib.loads(pyproject.read_text())["project"]["name"])
    return frozenset(names)


def _plugins():
    """The trainer's own plugins only: neither GEM_DISABLE_PLUGINS nor another installed plugin
    (its registrations, its `auto` answers) changes the page."""
    import importlib.metadata

    from gem_core.plugins import ENTRY_POINT_GROUP, build_plugins

    shipped = _repository_distributions()
    others = [entry.name for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
              if entry.dist is None or entry.dist.metadata["Name"] not in shipped]
    return build_plugins(disabled=others)


def _shipped_specs(plugins, kind: str) -> list:
    shipped = _repository_distributions()
    return [spec for spec in plugins.registry(kind).specs() if spec.distribution in shipped]


def capability_meanings() -> dict[str, str]:
    """Every capability name of :data:`CAPABILITY_MODULE` (its ``DECLARED_CAPABILITIES``), with
    what it means."""
    module = importlib.import_module(CAPABILITY_MODULE)
    source = inspect.getsource(module)
    lines = source.splitlines()
    body = ast.parse(source).body
    meanings: dict[str, str] = {}
    for index, node in enumerate(body):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id.isupper()
                and isinstance(node.value, ast.Constant)
                and node.value.value in module.DECLARED_CAPABILITIES):
            continue
        following = body[index + 1] if index + 1 < len(body) else None
        if (isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            doc = following.value.value
        else:  # ``#:`` comment lines just above the assignment
            comments, row = [], node.lineno - 2
            while row >= 0 and lines[row].lstrip().startswith("#:"):
                comments.insert(0, lines[row].lstrip()[2:].strip())
                row -= 1
            doc = " ".join(comments)
        if doc:
            meanings.setdefault(node.value.value, prose(doc))
    return meanings


def render_capabilities() -> str:
    from gem_core.kinds import KIND_TABLE

    plugins = _plugins()
    declared: dict[str, dict[str, list[str]]] = {}
    for kind in KIND_TABLE:
        for spec in _shipped_specs(plugins, kind.name):
            for capability in spec.capabilities:
                declared.setdefault(capability, {}).setdefault(kind.name, []).append(spec.name)
    meanings = capability_meanings()
    unknown = sorted(set(declared) - set(meanings))
    if unknown:
        raise LookupError(f"capabilities declared but not defined in {CAPABILITY_MODULE}: "
                          f"{', '.join(unknown)}")
    lines = ["| capability | declared by (kind: implementations) | meaning |", "|---|---|---|"]
    for capability in sorted(meanings):
        where = "; ".join(f"{kind}: {', '.join(f'`{n}`' for n in sorted(names))}"
                          for kind, names in declared.get(capability, {}).items()) or "(none)"
        lines.append(f"| `{capability}` | {where} | {_cell(meanings[capability])} |")
    return "\n".join(lines) + "\n"


def render_auto_order() -> str:
    from gem_core.kinds import KIND_TABLE

    plugins = _plugins()
    shipped = _repository_distributions()
    from gem_core.registry import AutoContext

    lines = ["| kind | plugins asked, in order | `auto` on one CPU process | "
             "`auto` on 2 CPU ranks |", "|---|---|---|---|"]
    contexts = (AutoContext(device="cpu"), AutoContext(device="cpu", world_size=2))
    for kind in KIND_TABLE:
        if kind.default_hook is None:
            continue
        order = [name for name in plugins.default_answerers(kind.name)
                 if plugins.distributions.get(name, (name, ""))[0] in shipped]
        answers = [plugins.default_for(kind.name, context) for context in contexts]
        lines.append(f"| `{kind.name}` | {' → '.join(f'`{n}`' for n in order)} | " + " | ".join(
            f"`{chosen}`: {_cell(reason)}" for chosen, reason in answers) + " |")
    return "\n".join(lines) + "\n"


def render_implementations() -> str:
    from gem_core.kinds import KIND_TABLE

    plugins = _plugins()
    lines = ["| kind | name | package | devices | dtypes | backward | capabilities | requires |",
             "|---|---|---|---|---|---|---|---|"]
    for kind in KIND_TABLE:
        if kind.name == "cli":
            continue  # docs/cli.md documents the commands
        for spec in _shipped_specs(plugins, kind.name):
            lines.append(
                f"| {kind.name} | `{spec.name}` | {spec.distribution} | "
                f"{', '.join(spec.devices)} | {', '.join(spec.dtypes)} | "
                f"{'yes' if spec.supports_backward else 'no'} | "
                f"{', '.join(sorted(spec.capabilities)) or '-'} | "
                f"{', '.join(spec.requires) or '-'} |")
    return "\n".join(lines) + "\n"


def renderers() -> dict[str, Callable[[], str]]:
    from gem_core.kinds import KIND_TABLE

    table: dict[str, Callable[[], str]] = {
        "kinds": render_kinds,
        "spec": lambda: "\n".join(render_class("gem_core.registry", name)
                                  for name in ("ImplementationSpec", "AutoContext")),
        "capabilities": render_capabilities,
        "auto-order": render_auto_order,
        "implementations": render_implementations,
    }
    for kind in KIND_TABLE:
        table[f"contract:{kind.name}"] = lambda name=kind.name: render_contract(name)
    return table


def render(page: str) -> str:
    """``page`` with every generated region rewritten."""
    known = renderers()
    found = [match["name"] for match in REGION.finditer(page)]
    unknown = sorted(set(found) - set(known))
    missing = sorted(set(known) - set(found))
    if unknown or missing:
        raise SystemExit(f"{DOC}: generated regions unknown to this tool: {unknown or 'none'}; "
                         f"regions the page lacks: {missing or 'none'}")
    note = "<!-- generated by tools/gen_extending_docs.py from the code: do not edit -->\n"
    return REGION.sub(lambda m: f"{m.group(1)}{note}\n{known[m['name']]()}\n{m.group(4)}", page)


def main() -> int:
    page = DOC.read_text()
    text = render(page)
    if "--check" in sys.argv:
        if text != page:
            stale = [new["name"] for old, new in zip(REGION.finditer(page), REGION.finditer(text))
                     if old["body"] != new["body"]]
            print(f"{DOC} is out of date (regions {', '.join(stale) or 'none'}; the code they "
                  "are generated from changed): run python tools/gen_extending_docs.py",
                  file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
