"""The shape of ``service/``: no import cycle between its packages or modules, and no module over the size limit.

Imports are read from the AST of every module, function-level ones included (a deferred import still ties the two
modules together; it only hides the cycle from the interpreter). Two graphs are checked: modules
(``service.model.llama`` -> ``service.model.config``) and the first-level packages they roll up to
(``service.model`` -> ``service.loading``). ``if TYPE_CHECKING:`` imports count too: a type that needs the other
module is a dependency on it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

from support.paths import ROOT

SERVICE = ROOT / "service"
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(SERVICE.rglob("*.py"))}


def _imported(tree: ast.AST, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The ``service`` modules one module's AST imports (``from a import b`` names ``a.b`` when that is a module).

    A parent package's ``__init__``, which Python runs before any of its modules, is not counted as imported."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from pkg import sub`` imports the module ``pkg.sub``; ``from pkg import name``, ``pkg`` itself
            subs = {f"{base}.{alias.name}" for alias in node.names} & known
            found.update(subs)
            if len(subs) < len(node.names):
                found.add(base)
    return {m for m in found if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    """Module -> the ``service`` modules it imports."""
    modules = _modules()
    known = set(modules)
    return {
        name: _imported(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py", known)
        for name, path in modules.items()
    }


def package_graph(modules: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph rolled up to first-level packages and modules (``service.model``, ``service.config``)."""

    def top(name: str) -> str:
        return ".".join(name.split(".")[:2])

    graph: dict[str, set[str]] = {top(m): set() for m in modules}
    for m, deps in modules.items():
        graph[top(m)].update(top(d) for d in deps if top(d) != top(m))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _describe(components: Iterable[list[str]], graph: dict[str, set[str]]) -> str:
    lines = []
    for component in components:
        members = set(component)
        edges = [f"{a} -> {b}" for a in component for b in sorted(graph[a] & members)]
        lines.append(" <-> ".join(component) + "\n    " + "\n    ".join(edges))
    return "\n".join(lines)


def test_cycles_finds_a_cycle_and_names_its_members() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert "a -> b" in _describe(cycles(graph), graph)


def test_imports_resolve_relative_and_from_forms() -> None:
    known = {"service.model", "service.model.llama", "service.model.config", "service.loading"}
    tree = ast.parse("from .config import X\nfrom service import loading\ndef f():\n    import service.model.llama\n")
    assert _imported(tree, "service.model.kv", False, known) == {"service.model.config", "service.loading",
                                                                 "service.model.llama"}  # fmt: skip


def test_no_import_cycle_between_packages() -> None:
    graph = package_graph(import_graph())
    found = cycles(graph)
    assert not found, "import cycles between service packages:\n" + _describe(found, graph)


def test_no_import_cycle_between_modules() -> None:
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles between service modules:\n" + _describe(found, graph)


def test_metrics_default_adapter_cap_is_the_settings_default() -> None:
    """``service.metrics`` keeps its own copy of the default so that it imports no configuration (no cycle)."""
    from service import metrics
    from service.config import Settings

    assert Settings().metrics_adapter_series == metrics.DEFAULT_ADAPTER_SERIES


def test_no_module_over_the_line_limit() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    over = {name: n for name, n in sorted(sizes.items()) if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines: " + ", ".join(f"{m} ({n})" for m, n in over.items())
