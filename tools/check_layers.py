"""Checks that bagua_hvd's source tree stays layered (issue 38): one function per check, each
returning its violations; ``python tools/check_layers.py`` runs them all and exits 1 with the
list when any fails.

- ``check_native_includes``: ``native/src/`` is a stack of folders, ``NATIVE_LAYERS`` from the
  bottom; a file may include its own folder and the folders below it, never one above it
  (docs/design-core.md, "Layers", states the same order).
- ``check_python_imports``: no import cycle among bagua_hvd's modules (module-level and
  function-level imports alike; a package's ``__init__`` may import its children, not the
  reverse), and no ``bagua_hvd.common`` module imports ``bagua_hvd.runner`` (the workers never
  import the launcher).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Set

REPO = Path(__file__).resolve().parent.parent

# native/src's folders, bottom first. Written once here; docs/design-core.md repeats it and
# tests/test_layers.py checks that the two agree.
NATIVE_LAYERS = (
    "base",
    "transport",
    "compression",
    "collectives",
    "requests",
    "engines",
    "ops",
    "core",
)

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
_NATIVE_SUFFIXES = {".h", ".cc", ".cu"}


def check_native_includes(
    src: Path = REPO / "native" / "src",
    layers: Sequence[str] = NATIVE_LAYERS,
    include_dirs: Sequence[Path] = (REPO / "native" / "include",),
) -> List[str]:
    """Every ``#include "..."`` under ``src``, resolved as the compiler does (the includer's
    folder, then ``src``, then ``include_dirs``), named by file; a violation is a file outside
    the layer folders or an include of a folder above the includer's (or of nothing)."""
    src = src.resolve()
    rank: Dict[str, int] = {name: i for i, name in enumerate(layers)}
    problems: List[str] = []
    for path in sorted(p for p in src.rglob("*") if p.suffix in _NATIVE_SUFFIXES):
        rel = path.relative_to(src)
        folder = rel.parts[0] if len(rel.parts) > 1 else None
        if folder not in rank:
            problems.append(f"{rel}: not in a layer folder ({', '.join(layers)})")
            continue
        for m in _INCLUDE_RE.finditer(path.read_text(errors="replace")):
            name = m.group(1)
            target = _resolve(name, path.parent, src, include_dirs)
            if target is None:
                problems.append(f'{rel}: #include "{name}" names no file')
                continue
            try:
                target_rel = target.relative_to(src)
            except ValueError:
                continue  # the public header (native/include): below every layer
            to = target_rel.parts[0] if len(target_rel.parts) > 1 else None
            if to not in rank:
                problems.append(f'{rel}: #include "{name}" is outside the layer folders')
            elif rank[to] > rank[folder]:
                problems.append(f'{rel}: #include "{name}": {folder}/ includes {to}/, above it')
    return problems


def _resolve(name: str, here: Path, src: Path, include_dirs: Sequence[Path]) -> Optional[Path]:
    for root in (here, src, *include_dirs):
        candidate = root / name
        if candidate.is_file():
            return candidate.resolve()
    return None


# ---- Python: bagua_hvd's import graph ----------------------------------------------------------
def python_modules(root: Path, package: str) -> Dict[str, Path]:
    """Every module of ``package`` (a folder under ``root``) by dotted name; a package is its
    ``__init__.py``."""
    modules: Dict[str, Path] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imported(node: ast.AST, module: str, is_package: bool, modules: Dict[str, Path]) -> List[str]:
    """The modules of ``modules`` that one import statement of ``module`` names: ``import
    a.b.c`` names a.b.c, or its longest prefix that is a module; ``from a.b import c`` names
    a.b.c where c is a submodule, else a.b (relative imports resolved)."""

    def known(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    if isinstance(node, ast.Import):
        return [known(alias.name) for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        here = module.split(".") if is_package else module.split(".")[:-1]
        here = here[: len(here) - (node.level - 1)]
        base = ".".join(here + ([base] if base else []))
    out = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        out.append(sub if sub in modules else known(base))
    return out


def import_graph(modules: Dict[str, Path]) -> Dict[str, Dict[str, int]]:
    """``{module: {imported module: line of its first import}}`` among ``modules`` (from
    :func:`python_modules`), module-level and nested (function-level) imports alike."""
    graph: Dict[str, Dict[str, int]] = {m: {} for m in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            for target in _imported(node, module, is_package, modules):
                if target and target != module:
                    graph[module][target] = min(graph[module].get(target, node.lineno), node.lineno)
    return graph


def strongly_connected(graph: Dict[str, Dict[str, int]]) -> List[List[str]]:
    """The strongly connected components of more than one module (each an import cycle),
    sorted (Tarjan's algorithm, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def check_python_imports(root: Path = REPO, package: str = "bagua_hvd") -> List[str]:
    """The Python layering of ``package``: no import cycle among its modules (module-level or
    function-level imports), and no ``<package>.common`` module importing
    ``<package>.runner`` (workers never import the launcher). Returns one message per
    problem."""
    modules = python_modules(root, package)
    graph = import_graph(modules)

    def where(module: str, line: int) -> str:
        return f"{modules[module].relative_to(root)}:{line}"

    problems = []
    for component in strongly_connected(graph):
        members = set(component)
        edges = [
            f"    {m} imports {t} ({where(m, line)})"
            for m in component
            for t, line in sorted(graph[m].items())
            if t in members
        ]
        problems.append(
            f"import cycle among {len(component)} modules: {', '.join(component)}\n"
            + "\n".join(edges)
        )

    def under(module: str, name: str) -> bool:
        return module == f"{package}.{name}" or module.startswith(f"{package}.{name}.")

    for module in sorted(graph):
        if under(module, "common"):
            for target, line in sorted(graph[module].items()):
                if under(target, "runner"):
                    problems.append(
                        f"{module} imports {target} ({where(module, line)}): "
                        f"{package}.common is imported by the workers, which never import "
                        "the launcher"
                    )
    return problems


CHECKS: Dict[str, Callable[[], List[str]]] = {
    "native/src include layers": check_native_includes,
    "bagua_hvd import graph": check_python_imports,
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    failed = False
    for title, check in CHECKS.items():
        problems = check()
        if problems:
            failed = True
            print(f"{title}: {len(problems)} violation(s)")
            for p in problems:
                print(f"  {p}")
        else:
            print(f"{title}: ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
