"""The package layering, read from the source: thc < dataplane < host, bfrt_scripts on
dataplane only, no import cycle among the project's modules, host.experiments imported by
nothing but itself, and a host.__all__ whose names exist.

Every import statement counts, at module level or inside a function (a deferred import is
still a dependency). `from package import name` depends on package.name when that is a
module, else on the package; the package __init__ that Python runs before any submodule
is not counted as a dependency of its submodules.
"""
import ast
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("thc", "dataplane", "host", "bfrt_scripts")
# the project packages each package may import (its own included)
ALLOWED = {
    "thc": {"thc"},
    "dataplane": {"thc", "dataplane"},
    "host": {"thc", "dataplane", "host"},
    "bfrt_scripts": {"dataplane", "bfrt_scripts"},
}
EXPERIMENTS = "host.experiments"


def _module_files() -> dict[str, Path]:
    """Dotted module name -> source file, for every .py file of the project's packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


MODULES = _module_files()


def _imported_names(module: str, path: Path):
    """(line, dotted name) of everything an import statement in the file names, relative
    imports resolved; `from X import a` names X.a (_project_module falls back to X)."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}" if base else alias.name


def _project_module(name: str) -> str | None:
    """The project module a dotted name lives in (its longest prefix that is one), or None
    for a name outside the project."""
    while name not in MODULES:
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return name


def _edges() -> dict[str, dict[str, int]]:
    """module -> {project module it imports: line of the first such import}."""
    edges = {}
    for module, path in MODULES.items():
        targets = {}
        for line, name in _imported_names(module, path):
            target = _project_module(name)
            if target is not None and target != module:
                targets.setdefault(target, line)
        edges[module] = targets
    return edges


EDGES = _edges()


def _where(module: str, line: int) -> str:
    return f"{MODULES[module].relative_to(ROOT)}:{line}"


def _strongly_connected(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or round a circle (Tarjan)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return groups


def test_every_package_is_parsed():
    """The checks below see each package (a wrong ROOT would make them pass on nothing)."""
    for package in PACKAGES:
        assert package in MODULES, f"{package}/__init__.py not found under {ROOT}"
    assert "thc.codec" in MODULES and "host.transport" in MODULES


def test_import_resolution():
    """Relative and `from package import module` imports resolve to the module."""
    assert "thc.cpu_kernels" in EDGES["thc.codec"]          # from . import cpu_kernels
    assert "thc.arrays" in EDGES["thc.codec"]               # from .arrays import is_cuda
    assert "thc.cuda_kernels" in EDGES["thc.codec"]         # imported inside a method


def test_no_lower_package_imports_a_higher_one():
    wrong = [f"{_where(m, line)}: {m} imports {t} (a {m.split('.')[0]} module may import "
             f"only {sorted(ALLOWED[m.split('.')[0]])})"
             for m, targets in sorted(EDGES.items()) for t, line in sorted(targets.items())
             if t.split(".")[0] not in ALLOWED[m.split(".")[0]]]
    assert not wrong, "layering thc < dataplane < host broken:\n" + "\n".join(wrong)


def test_no_import_cycle():
    cycles = _strongly_connected(EDGES)
    details = []
    for group in cycles:
        members = set(group)
        details.append(" <-> ".join(group) + ":\n" + "\n".join(
            f"    {_where(m, line)}: {m} imports {t}"
            for m in group for t, line in sorted(EDGES[m].items()) if t in members))
    assert not cycles, ("modules that import each other (move what they share into a "
                        "module both import):\n" + "\n".join(details))


def test_only_experiments_import_experiments():
    wrong = [f"{_where(m, line)}: {m} imports {t}"
             for m, targets in sorted(EDGES.items()) for t, line in sorted(targets.items())
             if (t == EXPERIMENTS or t.startswith(EXPERIMENTS + "."))
             and not (m == EXPERIMENTS or m.startswith(EXPERIMENTS + "."))]
    assert not wrong, ("library modules must not import the drivers in host.experiments:\n"
                       + "\n".join(wrong))


def test_host_public_names_exist():
    host = importlib.import_module("host")
    assert host.__all__, "host.__all__ is empty"
    missing = [name for name in host.__all__ if not hasattr(host, name)]
    assert not missing, f"host.__all__ names that host does not provide: {missing}"
    assert len(set(host.__all__)) == len(host.__all__), "host.__all__ repeats a name"
