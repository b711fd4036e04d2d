"""No import cycles among speclm's modules: every import, at module level or inside a function,
is an edge (``TYPE_CHECKING`` blocks excluded), and the graph must be acyclic."""

from __future__ import annotations

import ast
from pathlib import Path

import speclm

ROOT = Path(speclm.__file__).parent


def _module_name(path: Path) -> str:
    parts = ["speclm", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("speclm"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("speclm"):
                continue
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
            found.update(subs if len(subs) == len(node.names) else [target, *subs])
    return {m for m in found if m in modules and m != name}


def test_no_import_cycles():
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {name: _imports(path, set(files)) for name, path in files.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
