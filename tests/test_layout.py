"""The package's shape: small modules and classes, no import cycle, and a planner that imports no datapath.

Limits a reviewer would otherwise count by hand (and a session once broke without noticing): no module over 400 lines,
no class over 250, no two modules importing each other (directly or around a loop), and ``lightning_offload.planner``
pure, plain numbers in and plans out, so that it runs and is tested without a device."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_offload"
MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 250


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def runtime_imports(path: Path) -> set[str]:
    """The names ``path`` imports when it runs, anywhere in it but under ``if TYPE_CHECKING:``. ``from package
    import module`` counts as importing the module alone (the package is already being imported)."""
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module is not None:
                modules = [f"{node.module}.{alias.name}" for alias in node.names]
                found.update(m for m in modules if m in MODULES)
                if not all(m in MODULES for m in modules):
                    found.add(node.module)
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    visit([child])

    visit(ast.parse(path.read_text()).body)
    return found


def test_no_module_passes_400_lines_and_no_class_250() -> None:
    too_long = []
    for name, path in MODULES.items():
        source = path.read_text()
        if source.count("\n") > MAX_MODULE_LINES:
            too_long.append(f"{name}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                length = node.end_lineno - node.lineno + 1
                if length > MAX_CLASS_LINES:
                    too_long.append(f"{name}.{node.name}: {length} lines")
    assert not too_long, too_long


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in graph[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    return cycles


def test_no_two_modules_import_each_other_even_around_a_loop() -> None:
    graph = {name: (runtime_imports(path) & MODULES.keys()) - {name} for name, path in MODULES.items()}
    assert import_cycles(graph) == []


def test_the_cycle_finder_finds_a_loop_of_three() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]


def test_the_planner_imports_neither_torch_nor_any_datapath_module() -> None:
    """Plain numbers in, plans out: the planner may import itself and the package's units, nothing of torch (so not
    ``torch.cuda``) and nothing of the engine, the queues or the transfer."""
    allowed = {"lightning_offload.units"}
    for name, path in MODULES.items():
        if not name.startswith("lightning_offload.planner"):
            continue
        for imported in runtime_imports(path):
            assert imported.split(".")[0] != "torch", f"{name} imports {imported}"
            if imported.startswith("lightning_offload") and imported != "lightning_offload":
                assert imported.startswith("lightning_offload.planner") or imported in allowed, (
                    f"{name} imports {imported}"
                )
