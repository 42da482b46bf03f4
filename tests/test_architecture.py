"""docs/architecture.md's import rules hold for every import in pollen/.

The page's "Import rules" table puts each package and top-level module of
`pollen/` on a floor; these tests read the table and the source (every
`import`, inside functions too) and fail on an import up the table, a
circle between modules, a part of `pollen/` the table does not place, or
the ClientApp reaching into the server's `strategies/`.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import PROJECT

PACKAGE = PROJECT / "pollen"
PAGE = PROJECT / "docs" / "architecture.md"


def floors() -> dict[str, int]:
    """Unit name (a package or top-level module under pollen/) -> its floor."""
    section = PAGE.read_text().split("## Import rules", 1)[1].split("\n## ", 1)[0]
    placed = {}
    for floor, units in re.findall(r"^\| (\d+) \| ([^|]+) \|", section, re.M):
        for unit in re.findall(r"`([\w]+)`", units):
            placed[unit] = int(floor)
    return placed


def module_name(path: Path) -> str:
    parts = path.relative_to(PROJECT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> Iterator[str]:
    """The pollen modules and names `path` imports, absolute, anywhere in it."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], base])
            names = [f"{base.rstrip('.')}.{alias.name}" for alias in node.names]
        else:
            continue
        yield from (name for name in names if name.split(".")[0] == "pollen")


def import_graph() -> dict[str, set[str]]:
    """Module -> the pollen modules it imports (a name resolves to its module)."""
    sources = {module_name(p): p for p in PACKAGE.rglob("*.py")}

    def resolve(name: str) -> str:
        while name not in sources:
            name = name.rpartition(".")[0]
        return name

    return {
        module: {resolve(name) for name in imported(path)} - {module}
        for module, path in sources.items()
    }


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_the_page_places_every_package_and_module() -> None:
    placed = floors()
    units = {unit(m) for m in import_graph()}
    assert units - set(placed) == set(), "add these to docs/architecture.md"
    assert set(placed) - units == set(), "the page names what pollen/ lacks"


def upward_imports(graph: dict[str, set[str]], placed: dict[str, int]) -> list[str]:
    return [
        f"{module} -> {target}"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if placed[unit(target)] > placed[unit(module)]
    ]


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (its modules in order), or None."""
    finished: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in finished:
            return None
        for target in sorted(graph.get(module, ())):
            if found := visit(target, [*path, module]):
                return found
        finished.add(module)
        return None

    return next(filter(None, (visit(m, []) for m in sorted(graph))), None)


def test_no_import_runs_up_the_table() -> None:
    assert upward_imports(import_graph(), floors()) == []


def test_no_modules_import_each_other_round_a_circle() -> None:
    assert circle(import_graph()) is None


def test_the_client_app_imports_nothing_of_the_servers_parts() -> None:
    assert {
        m for m in import_graph()["pollen.client_app"] if unit(m) == "strategies"
    } == set()


def test_the_checks_catch_an_upward_import_and_a_circle() -> None:
    graph = {
        "pollen.settings": {"pollen.strategies.fedavg"},
        "pollen.strategies.fedavg": {"pollen.strategies.round"},
        "pollen.strategies.round": {"pollen.strategies.fedavg"},
    }
    assert upward_imports(graph, floors()) == [
        "pollen.settings -> pollen.strategies.fedavg"
    ]
    assert circle(graph) == [
        "pollen.strategies.fedavg", "pollen.strategies.round", "pollen.strategies.fedavg"
    ]  # fmt: skip


def test_relative_imports_resolve_to_absolute_modules() -> None:
    names = set(imported(PACKAGE / "strategies" / "fednova.py"))
    assert "pollen.common.steps.effective_steps" not in names
    assert "pollen.strategies.aggregation.ClientUpdate" in names
    assert "pollen.protocol.EFFECTIVE_STEPS" in names
