"""Imports point one way: the import graph of course_lib, read from the source (no module is imported).

Every `import` and `from ... import` in course_lib is an edge, at module level AND inside
functions (a function-level import is a dependency all the same: it only runs later). Relative
imports are resolved, and `from pkg import name` points at the submodule pkg.name when there is
one. Checked:

    no cycle among files                          (reported as a path a -> b -> a)
    no cycle among the top-level packages         course_lib.X; a single module course_lib/x.py is
                                                  its own package; course_lib/__init__.py (the
                                                  re-exports for notebooks) is left out
    estimate/ starts no process                   none of its modules imports the runtime, the
                                                  measuring package, torch.distributed,
                                                  multiprocessing or subprocess
    function-level imports of course_lib          only of the OPTIONAL modules below
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "course_lib"

# Modules a function may import instead of the module top: their own imports (ipywidgets,
# matplotlib, IPython) are optional and slow, so a figure module loads them only when a widget
# or figure is asked for. Anything else is imported at the top of the module that needs it.
OPTIONAL = {
    "course_lib.widgets",  # the notebooks' widgets and static views: ipywidgets, matplotlib, IPython
}

# Cycles that exist today and are being removed by other work: pairs of files or packages (a, b)
# whose edges both ways are ignored. Each pair must still be a cycle (a stale entry fails), so
# this set only shrinks. Empty: estimate <-> parallel (removed by the lead's dims.py) and
# model.gpt <-> model.moe (helper B) are gone.
KNOWN: set[frozenset[str]] = set()

# What estimate/ (pure formulas) must not reach for: the modules that start ranks or processes.
NO_PROCESS = ("course_lib.runtime", "course_lib.measure", "torch.distributed", "multiprocessing", "subprocess")


def module_names(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every .py file under root (a package's __init__.py is the package)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> list[tuple[str, str, int, bool]]:
    """(imported name as written, the course module it resolves to or '', line, inside a function)
    for every import statement of the module `name`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []

    def resolve(dotted: str) -> str:
        while dotted and dotted not in modules:  # `import a.b.c` of a name inside a.b: the module a.b
            dotted = dotted.rpartition(".")[0]
        return dotted

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    out.append((alias.name, resolve(alias.name), child.lineno, in_function))
            elif isinstance(child, ast.ImportFrom):
                if child.level:  # from . import x / from ..a import x, relative to this module's package
                    base = package.split(".")[:len(package.split(".")) - (child.level - 1)]
                    source = ".".join(base + ([child.module] if child.module else []))
                else:
                    source = child.module
                for alias in child.names:
                    sub = f"{source}.{alias.name}"
                    target = sub if sub in modules else source
                    out.append((target, resolve(target), child.lineno, in_function))
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), False)
    return out


def import_graph(root: pathlib.Path = ROOT):
    """(modules, {module: {imported course module: first line}}, every import record per module)."""
    modules = module_names(root)
    records = {name: imports_of(name, path, modules) for name, path in modules.items()}
    edges = {name: {} for name in modules}
    for name, recs in records.items():
        for _, target, line, _ in recs:
            if target and target != name:
                edges[name].setdefault(target, line)
    return modules, edges, records


def package_of(module: str) -> str | None:
    """course_lib.X for every module below course_lib.X (course_lib.x for a single module x.py);
    None for course_lib itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else None


def package_graph(edges) -> dict[str, dict[str, str]]:
    """{package: {package it imports: 'file:line -> module' of one such import}}."""
    out = {}
    for module, targets in edges.items():
        a = package_of(module)
        if a is None:
            continue
        out.setdefault(a, {})
        for target, line in targets.items():
            b = package_of(target)
            if b is not None and b != a:
                out[a].setdefault(b, f"{module}:{line} -> {target}")
    return out


def without_known(graph: dict, known=None) -> dict:
    known = KNOWN if known is None else known
    return {a: {b: v for b, v in targets.items() if frozenset((a, b)) not in known} for a, targets in graph.items()}


def find_cycle(graph: dict) -> list[str] | None:
    """One cycle of `graph` ({node: {successor: ...}}) as a path [a, b, ..., a], or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = {node: WHITE for node in graph}
    for start in sorted(graph):
        if colour[start] != WHITE:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        colour[start] = GREY
        while stack:
            node, successors = stack[-1]
            nxt = next(successors, None)
            if nxt is None:
                colour[node] = BLACK
                stack.pop()
                path.pop()
            elif colour.get(nxt, BLACK) == GREY:
                return path[path.index(nxt):] + [nxt]
            elif colour.get(nxt, BLACK) == WHITE:
                colour[nxt] = GREY
                stack.append((nxt, iter(sorted(graph.get(nxt, ())))))
                path.append(nxt)
    return None


def describe(cycle: list[str], graph: dict) -> str:
    steps = [f"{a} -> {b}  ({graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
    return " -> ".join(cycle) + "\n  " + "\n  ".join(steps)


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_the_graph_reads_the_whole_library(graph):
    modules, edges, _ = graph
    assert "course_lib.estimate.step_time" in modules and "course_lib.measure" in modules
    # `from pkg import name` of a package's own submodule, and a function-level import, are both edges
    assert "course_lib.estimate.per_gpu" in edges["course_lib.estimate"]
    assert "course_lib.widgets" in edges["course_lib.estimate.planner_figures"]


def test_no_cycle_among_files(graph):
    _, edges, _ = graph
    lines = {a: {b: f"line {line}" for b, line in targets.items()} for a, targets in edges.items()}
    cycle = find_cycle(without_known(lines))
    assert cycle is None, "import cycle among files: " + describe(cycle, lines)


def test_no_cycle_among_packages(graph):
    _, edges, _ = graph
    packages = package_graph(edges)
    cycle = find_cycle(without_known(packages))
    assert cycle is None, "import cycle among packages: " + describe(cycle, packages)


def test_known_cycles_still_exist(graph):
    """KNOWN only shrinks: an entry whose cycle is gone must be deleted from it."""
    _, edges, _ = graph
    both = {**{a: set(t) for a, t in edges.items()}, **{a: set(t) for a, t in package_graph(edges).items()}}
    for pair in KNOWN:
        a, b = sorted(pair)
        assert b in both.get(a, ()) and a in both.get(b, ()), f"{a} <-> {b} is no longer a cycle: remove it from KNOWN"


def test_estimate_starts_no_process(graph):
    _, _, records = graph
    estimate = [m for m in records if m == "course_lib.estimate" or m.startswith("course_lib.estimate.")]
    bad = [f"{module}:{line} imports {name}"
           for module in estimate for name, _, line, _ in records[module]
           if any(name == p or name.startswith(p + ".") for p in NO_PROCESS)]
    assert not bad, "estimate/ holds formulas only; what runs ranks belongs in course_lib.measure:\n" + "\n".join(bad)


def test_function_level_imports_are_only_of_optional_modules(graph):
    _, _, records = graph
    bad = [f"{module}:{line} imports {target} inside a function"
           for module, recs in records.items() for _, target, line, in_function in recs
           if in_function and target and target not in OPTIONAL]
    assert not bad, ("import these at the top of the module (a function-level import is only for the optional "
                     "modules in OPTIONAL):\n" + "\n".join(bad))


def test_a_cycle_is_found_and_reported_as_a_path(tmp_path):
    """The checks above can fail: a small package with a cycle through a function-level, a
    relative and a `from pkg import submodule` import."""
    pkg = tmp_path / "course_lib"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from . import y\n")
    (pkg / "a" / "y.py").write_text("def f():\n    from course_lib.b import z\n")
    (pkg / "b.py").write_text("from course_lib.a import x\nz = 1\n")
    modules, edges, records = import_graph(pkg)
    assert edges["course_lib.a.x"] == {"course_lib.a.y": 1} and edges["course_lib.b"] == {"course_lib.a.x": 1}
    assert [r for r in records["course_lib.a.y"] if r[3]] == [("course_lib.b", "course_lib.b", 2, True)]
    cycle = find_cycle(edges)
    assert cycle is not None and cycle[0] == cycle[-1] and len(cycle) == 4
    assert set(cycle) == {"course_lib.a.x", "course_lib.a.y", "course_lib.b"}
    assert find_cycle(package_graph(edges)) in (["course_lib.a", "course_lib.b", "course_lib.a"],
                                                ["course_lib.b", "course_lib.a", "course_lib.b"])
    assert find_cycle(without_known(package_graph(edges), {frozenset(("course_lib.a", "course_lib.b"))})) is None
