"""The package's shape, read from its source with ``ast`` (nothing is imported): no import cycle between
modules, no import from a lower layer into a higher one, no function over 80 lines, no module over 500.

Layers, lowest first (docs/architecture.md); a module may import its own layer (if acyclic) and lower ones:
errors/outputs/validate/tables/layout -> stats -> cost -> data/sim -> plan/train/hbp -> integrations/examples -> jobs
-> measure -> cli.
Every import counts: module level, inside functions, under ``if TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "omnibal"
LAYERS = {
    "errors": 0, "outputs": 0, "validate": 0, "tables": 0, "layout": 0, "processes": 0,
    "stats": 1,
    "cost": 2,
    "data": 3, "sim": 3,
    "plan": 4, "train": 4, "hbp": 4,
    "integrations": 5, "examples": 5,
    "jobs": 6,
    "measure": 7,
    "cli": 8, "__main__": 8,  # ``python -m omnibal`` is the command line's entry point
    "__init__": 1,  # the package root re-exports errors and stats.SampleStats only
}
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 500

# Items owned by other branches of the renovation (issue 21); all fixed and merged: the list stays empty.
KNOWN: set[str] = set()


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    is_package: bool
    tree: ast.Module
    lines: int


def _modules() -> dict[str, Module]:
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        text = path.read_text()
        out[".".join(parts)] = Module(".".join(parts), path, is_package, ast.parse(text, str(path)),
                                      len(text.splitlines()))
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module of ``name`` (a module, or an attribute of one): its longest prefix that is a module."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(mod: Module) -> set[str]:
    """omnibal modules ``mod`` imports, anywhere in it."""
    package = mod.name if mod.is_package else mod.name.rpartition(".")[0]
    found = set()
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # ``from pkg import sub`` imports the submodule; ``from mod import name`` the module
            found.update(f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target for a in node.names)
    resolved = {_resolve(t) for t in found if t == PACKAGE or t.startswith(PACKAGE + ".")}
    return {t for t in resolved if t and t != mod.name}


GRAPH = {name: _imports(mod) for name, mod in MODULES.items()}


def _layer(name: str) -> int:
    parts = name.split(".")
    if parts[-1] == "__main__":  # an entry point (``python -m``) is the command line's, wherever it sits
        return LAYERS["__main__"]
    key = parts[1] if len(parts) > 1 else "__init__"
    assert key in LAYERS, f"{name}: a new top-level part of the package needs a layer in LAYERS and the docs"
    return LAYERS[key]


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    counter = 0
    for root in sorted(GRAPH):
        if root in index:
            continue
        work = [(root, iter(sorted(GRAPH[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(GRAPH[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def _unexpected(found: list[str]) -> list[str]:
    return [item for item in found if item not in KNOWN]


def test_no_import_cycles():
    cycles = ["cycle " + " ".join(c) for c in _cycles()]
    assert not _unexpected(cycles), "\n".join(_unexpected(cycles))


def test_no_upward_imports():
    bad = [f"{a} imports {b} (layer {_layer(a)} -> {_layer(b)})" for a in sorted(GRAPH) for b in sorted(GRAPH[a])
           if _layer(b) > _layer(a)]
    assert not bad, "lower layers must not import higher ones:\n" + "\n".join(bad)


def test_functions_and_modules_are_short():
    found = []
    for mod in MODULES.values():
        if mod.lines > MAX_MODULE_LINES:
            found.append(f"module {mod.name}")
        for node in ast.walk(mod.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"function {mod.name}.{node.name}")
    assert not _unexpected(found), (f"over {MAX_FUNCTION_LINES} lines per function / {MAX_MODULE_LINES} per "
                                    "module:\n" + "\n".join(_unexpected(found)))


def test_known_items_still_exist():
    """An item fixed elsewhere leaves KNOWN (so the list only shrinks)."""
    present = {"cycle " + " ".join(c) for c in _cycles()}
    for mod in MODULES.values():
        present |= {f"function {mod.name}.{n.name}" for n in ast.walk(mod.tree)
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES}
    assert KNOWN <= present, f"fixed, remove from KNOWN: {sorted(KNOWN - present)}"


def test_the_checker_sees_what_it_should():
    """The graph is not empty, and imports inside functions and relative imports are followed."""
    assert GRAPH["omnibal.measure.runner"] >= {"omnibal.train.layers", "omnibal.data.collate"}
    assert "omnibal.cli" in GRAPH["omnibal.__main__"]
    tree = ast.parse("def f():\n    from . import table\n")
    probe = Module("omnibal.stats.probe", SRC / "x.py", False, tree, 2)
    assert _imports(probe) == {"omnibal.stats.table"}


# Benchmarks the integrator converts at merge (they still import the tests' helpers / edit sys.path); the list only
# shrinks: test_known_benchmarks_still_break_the_rule fails once one is converted.
KNOWN_BENCHMARKS = {"bench_balance"}
BENCH = SRC.parent / "benchmarks"
BENCH_HELPERS = {"common", "cpu_runs", "trainer_runs", "sim_links"}


def _benchmark_violations(path: Path) -> list[str]:
    """Where the benchmark module ``path`` imports another benchmark or the tests' helpers, or edits sys.path."""
    local = {p.stem for p in BENCH.glob("*.py")} | {p.stem for p in (SRC.parent / "tests").glob("*.py")}
    bad = []
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] in local or (parts[0] == "benchmarks" and len(parts) > 1
                                     and parts[1] not in BENCH_HELPERS and parts[1] in local):
                bad.append(f"{path.name}:{node.lineno} imports {name}")
        if isinstance(node, ast.Attribute) and ast.unparse(node) == "sys.path":
            bad.append(f"{path.name}:{node.lineno} edits sys.path")
    return bad


def test_benchmarks_import_helpers_only():
    """A benchmark imports omnibal, third-party packages and the benchmarks' helper modules, never another
    benchmark or the tests' helpers, and does not edit ``sys.path`` (it runs as ``python -m benchmarks.X``)."""
    bad = [v for path in sorted(BENCH.glob("*.py")) if path.stem not in KNOWN_BENCHMARKS
           for v in _benchmark_violations(path)]
    assert not bad, "\n".join(bad)


def test_known_benchmarks_still_break_the_rule():
    """A benchmark converted elsewhere leaves KNOWN_BENCHMARKS (so the list only shrinks)."""
    fixed = sorted(name for name in KNOWN_BENCHMARKS
                   if not (BENCH / f"{name}.py").is_file() or not _benchmark_violations(BENCH / f"{name}.py"))
    assert not fixed, f"converted, remove from KNOWN_BENCHMARKS: {fixed}"


def test_no_re_exports_no_dynamic_imports_no_duck_typed_plan():
    """A module is imported where it lives: no name imported only to be re-exported (``noqa: F401``) in the
    package or the tests, no ``__import__`` in the command line, no ``PlannedRun`` copy of ``Plan``."""
    tests = Path(__file__).resolve().parent
    bad = []
    for path in [*sorted((SRC / PACKAGE).rglob("*.py")), *sorted(tests.glob("*.py"))]:
        if path.name == Path(__file__).name:
            continue
        text = path.read_text()
        if "noqa: F401" in text:
            bad.append(f"{path.name}: a re-export (noqa: F401)")
        if "class PlannedRun" in text:
            bad.append(f"{path.name}: PlannedRun")
        if path.is_relative_to(SRC / PACKAGE / "cli") and "__import__(" in text:
            bad.append(f"{path.name}: __import__ in the command line")
    assert not bad, "\n".join(bad)
