"""docs/architecture.md's table of where things live in gem-core names every module."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
GEM_CORE = REPO / "packages" / "gem-core" / "src" / "gem_core"
SECTION = "## Where things live (gem-core)"


def _named_paths() -> list[str]:
    """The paths in the module column of the table, relative to gem_core."""
    text = DOC.read_text()
    assert SECTION in text, f"{DOC} has no section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert len(rows) > 2, f"no table under {SECTION!r}"
    paths = []
    for row in rows[2:]:  # past the header and its rule
        module_column = row.strip().strip("|").rsplit("|", 1)[-1]
        paths += re.findall(r"`([^`]+)`", module_column)
    return paths


def _top_level_modules() -> set[str]:
    """Every top-level module (``name.py``) and subpackage (``name/``) of gem_core."""
    modules = {p.name for p in GEM_CORE.glob("*.py") if p.name != "__init__.py"}
    packages = {f"{p.name}/" for p in GEM_CORE.iterdir() if (p / "__init__.py").is_file()}
    return modules | packages


def test_every_module_and_subpackage_of_gem_core_is_in_the_table():
    named = {path.split("/", 1)[0] + ("/" if "/" in path else "") for path in _named_paths()}
    missing = sorted(_top_level_modules() - named)
    assert not missing, (f"docs/architecture.md ({SECTION}) does not name {', '.join(missing)}: "
                         "add a row (or the module to a row) saying what it holds")


def test_every_path_in_the_table_exists():
    absent = [path for path in _named_paths() if not list(GEM_CORE.glob(path.rstrip("/")))]
    assert not absent, f"docs/architecture.md ({SECTION}) names paths gem_core lacks: {absent}"
