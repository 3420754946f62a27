"""The layering of the five packages, checked on every import statement of their sources.

Read from the source (``ast``), not by importing: every ``import`` and ``from ... import`` of every
module under ``packages/*/src``, at module level, inside functions and under
``if TYPE_CHECKING:`` alike (a type-only import is still an arrow a reader follows), with
relative imports resolved. Importing ``a.b.c`` runs ``a/b/__init__.py`` first, so an import also
reaches the packages above its target (except the importer's own packages, already running, and
a distribution's root package, see :data:`ROOT_PACKAGES`).

1. A plugin package imports no first-party package but gem-core.
2. gem-core imports no plugin package.
3. Inside gem-core, no module imports a module of a higher layer (:data:`LAYERS`).
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORE = "gem_core"
PLUGINS = ("gem_data", "gem_kernels", "gem_parallel", "gem_precision")
FIRST_PARTY = (CORE, *PLUGINS)

#: Every gem-core import also runs ``gem_core/__init__.py``: it holds ``hookimpl`` and
#: ``__version__`` and imports only ``hookspecs``, which needs nothing first-party at run time.
#: It is not an arrow from every module; an explicit ``from gem_core import hookimpl`` is.
ROOT_PACKAGES = frozenset(FIRST_PARTY)

#: gem-core's layers, lowest first: a module may import its own layer and the layers below it,
#: never one above. An entry names a module, or a package with everything under it; the most
#: specific entry wins, and ``pkg.__init__`` names a package's own ``__init__.py`` apart from
#: its submodules.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # Names, errors, data types, files and the maths every other layer is written in: the
    # schema and the request batch, configs, jagged tensors, FLOP formulas and metrics, the
    # checkpoint files, the process group, the engine a strategy returns, and the attention
    # call's parameters, mask and relative bias (the types a backend's signature uses).
    ("foundations", (
        "gem_core.errors", "gem_core.capabilities", "gem_core.jagged", "gem_core.flops",
        "gem_core.metrics", "gem_core.logs", "gem_core.process_life", "gem_core.rank_exit",
        "gem_core.stack_dump",
        "gem_core.config", "gem_core.schema", "gem_core.batch", "gem_core.embedding_tables",
        # The checkpoint package: its layout, retention, digests and safe reading (the
        # checkpointer, the resume checks and the sharded modules' storage are run parts).
        "gem_core.checkpoint",
        "gem_core.distributed", "gem_core.engine", "gem_core.plan_estimate",
        "gem_core.attention.__init__", "gem_core.attention.api", "gem_core.attention.masks",
        "gem_core.attention.relative_bias",
    )),
    # What each kind of plugin implements and what the trainer relies on in a model: abstract
    # classes over the foundations' types, implementing nothing.
    ("contracts", ("gem_core.contracts",)),
    # The plugin machinery (kinds, hooks, registries, resolution and the start-up checks of a
    # choice against its declared capabilities) and gem-core's own implementations of the
    # contracts: the reference attention backends, norm, embedding, precision, data, strategy.
    ("plugins", (
        "gem_core.__init__", "gem_core.kinds", "gem_core.hookspecs", "gem_core.registry",
        "gem_core.plugins", "gem_core.builtin_plugin", "gem_core.attention", "gem_core.norm",
        "gem_core.embedding", "gem_core.embedding_fused", "gem_core.ids", "gem_core.precision",
        "gem_core.data", "gem_core.single_process",
    )),
    # The GEM model, built from injected backends.
    ("model", ("gem_core.model",)),
    # What a run is made of below the loop that drives it, and what opening a trained run
    # needs (the distillation's teacher opens one): resolving the backends, applying the
    # strategies and the compiler, checkpoints and their reading back.
    ("run parts", (
        "gem_core.compile", "gem_core.parallelize", "gem_core.train.backends",
        # The config as the data source applies it: the trainer, an opened trained run, the
        # benches and gem plan build their model from it.
        "gem_core.train.applied",
        "gem_core.checkpoint.checkpointer", "gem_core.checkpoint.resume",
        "gem_core.checkpoint.sharded_modules",
        "gem_core.trained_run",
        # The package's own __init__ imports nothing, so importing these parts of it does not
        # import the training loop.
        "gem_core.train.__init__",
    )),
    # Distillation: a teacher (a trained run) and the student's loss, which the trainer uses.
    ("distillation", ("gem_core.distill",)),
    # The training loop and everything else of gem_core.train (a new module of it lands here,
    # where it may import anything below).
    ("trainer", ("gem_core.train",)),
    # What reads or drives whole runs: serving exports, reports, the test helpers of plugins.
    ("applications", ("gem_core.serving", "gem_core.report", "gem_core.testing")),
    # The command line, on top of everything.
    ("cli", ("gem_core.cli",)),
)


def _module_name(path: Path, src: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(src).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


@lru_cache(maxsize=None)
def _modules() -> dict[str, tuple[Path, bool]]:
    """``{dotted name: (file, is a package __init__)}`` of every first-party module."""
    found: dict[str, tuple[Path, bool]] = {}
    for src in sorted((REPO / "packages").glob("*/src")):
        for path in sorted(src.rglob("*.py")):
            name, is_package = _module_name(path, src)
            if name.split(".")[0] in FIRST_PARTY:
                found[name] = (path, is_package)
    return found


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The first-party modules one import statement names (absolute, resolved)."""
    modules = _modules()
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        # ``from pkg import sub`` imports the submodule; ``from pkg import name`` the package.
        names = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                 for alias in node.names]
    return [name for name in names if name.split(".")[0] in FIRST_PARTY]


def _with_parents(target: str, importer: str) -> list[str]:
    """``target`` and the packages whose ``__init__`` importing it runs: its ancestors, less the
    importer's own (already running) and the distribution roots."""
    parts = target.split(".")
    reached = [target]
    for depth in range(1, len(parts)):
        parent = ".".join(parts[:depth])
        if parent in ROOT_PACKAGES or importer == parent or importer.startswith(parent + "."):
            continue
        reached.append(parent)
    return reached


@lru_cache(maxsize=None)
def imports() -> tuple[tuple[str, Path, int, str, str], ...]:
    """Every first-party arrow: ``(importer, file, line, module named, module reached)``."""
    arrows = []
    for module, (path, is_package) in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for named in _targets(module, is_package, node):
                for reached in _with_parents(named, module):
                    arrows.append((module, path, node.lineno, named, reached))
    return tuple(arrows)


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(REPO)}:{line}"


def test_plugins_import_only_gem_core_among_first_party_packages():
    wrong = [f"{_where(path, line)} imports {named}"
             for importer, path, line, named, reached in imports()
             if importer.split(".")[0] in PLUGINS
             and reached.split(".")[0] not in (CORE, importer.split(".")[0])]
    assert not wrong, "a plugin package imports another plugin package:\n" + "\n".join(wrong)


def test_gem_core_imports_no_plugin_package():
    wrong = [f"{_where(path, line)} imports {named}"
             for importer, path, line, named, reached in imports()
             if importer.split(".")[0] == CORE and reached.split(".")[0] in PLUGINS]
    assert not wrong, "gem-core imports a plugin package:\n" + "\n".join(wrong)


def test_the_root_packages_import_nothing_first_party_at_run_time():
    """What lets :data:`ROOT_PACKAGES` be no arrow from every module: a distribution's
    ``__init__.py`` imports at most gem-core's ``hookspecs``, and that only type names."""
    wrong = []
    for root in ROOT_PACKAGES:
        for node in _runtime_imports(root):
            names = _targets(root, True, node)
            wrong += [f"{root} imports {n}" for n in names if n != "gem_core.hookspecs"]
    wrong += [f"gem_core.hookspecs imports {n}" for node in _runtime_imports("gem_core.hookspecs")
              for n in _targets("gem_core.hookspecs", False, node)]
    assert not wrong, "a root package's import runs first-party code:\n" + "\n".join(wrong)


def _runtime_imports(module: str) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of ``module`` outside ``if TYPE_CHECKING:`` blocks."""
    path, _ = _modules()[module]
    tree = ast.parse(path.read_text(), str(path))
    type_only = {id(inner) for node in ast.walk(tree)
                 if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
                 for inner in ast.walk(node)}
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
            and id(node) not in type_only]


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of ``module`` (the most specific entry), or None."""
    entries = {name: index for index, (_, names) in enumerate(LAYERS) for name in names}
    candidates = []
    if _modules().get(module, (None, False))[1]:
        candidates.append(f"{module}.__init__")
    parts = module.split(".")
    candidates += [".".join(parts[:depth]) for depth in range(len(parts), 0, -1)]
    return next((entries[c] for c in candidates if c in entries), None)


def _init_name(module: str) -> str:
    return f"{module}.__init__" if _modules().get(module, (None, False))[1] else module


def test_every_gem_core_module_has_a_layer():
    missing = sorted(m for m in _modules() if m.split(".")[0] == CORE and layer_of(m) is None)
    assert not missing, (f"modules of gem-core in no layer: {', '.join(missing)}; add each to "
                         "LAYERS in tests/test_layering.py where it belongs")


def test_the_layer_entries_name_modules_that_exist():
    modules = _modules()
    absent = [name for _, names in LAYERS for name in names
              if name.removesuffix(".__init__") not in modules]
    assert not absent, f"LAYERS names modules that do not exist: {absent}"


def test_no_gem_core_module_imports_a_higher_layer():
    wrong = []
    for importer, path, line, named, reached in imports():
        if importer.split(".")[0] != CORE or reached.split(".")[0] != CORE:
            continue
        low, high = layer_of(importer), layer_of(reached)
        if low is None or high is None or high <= low:
            continue
        via = "" if named == reached else f" (whose package {reached} it runs)"
        wrong.append(f"{_where(path, line)}: {importer} (layer {LAYERS[low][0]!r}) imports "
                     f"{named}{via} (layer {LAYERS[high][0]!r})")
    assert not wrong, "imports up the layers of gem-core:\n" + "\n".join(wrong)
