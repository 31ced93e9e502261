"""The package's layers import downward only, and no modules import each other in a cycle.

Layer order (docs/DESIGN.md): errors -> model (with chat) -> kv -> methods -> workflow | serve
-> eval -> experiments -> cli. Imports inside functions count too: a lazy import is still a
dependency. Siblings on one level (workflow, serve) do not import each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvcmas"

LAYERS: list[set[str]] = [
    {"__init__", "errors"},
    {"model", "chat"},
    {"kv"},
    {"methods"},
    {"workflow", "serve"},
    {"eval"},
    {"experiments"},
    {"cli"},
]


def top_part(module: str) -> str:
    """``kvcmas.methods.kvcmas`` -> ``methods``; ``kvcmas.cli`` -> ``cli``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def level(part: str) -> int:
    for i, names in enumerate(LAYERS):
        if part in names:
            return i
    raise AssertionError(f"kvcmas.{part} is in no layer: add it to LAYERS in {__file__}")


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every ``kvcmas`` module ``path`` imports, at any depth of its code."""
    tree = ast.parse(path.read_text())
    here = module_name(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]  # the package a relative import starts from
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "kvcmas"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "kvcmas":
                continue
            for alias in node.names:  # `from kvcmas.eval import data` imports a module
                candidate = f"{base}.{alias.name}"
                found.add(candidate if resolve(candidate) else base)
    return found


def resolve(module: str) -> Path | None:
    rel = Path(*module.split(".")[1:])
    for path in (PACKAGE / rel.with_suffix(".py"), PACKAGE / rel / "__init__.py"):
        if path.is_file():
            return path
    return None


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in imports_of(p) if m != name} for name, p in modules.items()}


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in edges.items():
        a = top_part(src)
        for dst in targets:
            b = top_part(dst)
            if a != b and level(b) >= level(a):
                bad.append(f"{src} imports {dst} ({a} is not above {b})")
    return sorted(bad)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in edges:
                continue
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_import_points_down_the_layers():
    assert upward_imports(graph()) == []


def test_no_module_import_cycles():
    edges = graph()
    # A package's __init__ re-exporting its own modules is not a cycle between modules.
    for name in edges:
        edges[name] = {m for m in edges[name] if not name.startswith(m + ".")}
    assert cycles(edges) == []


def test_the_checks_catch_what_they_forbid():
    """The detectors themselves: an upward import, a sideways one and a cycle are reported."""
    edges = {
        "kvcmas.methods.a": {"kvcmas.workflow.runner"},  # upward
        "kvcmas.workflow.runner": {"kvcmas.serve.x"},  # sideways (same level)
        "kvcmas.eval.p": {"kvcmas.eval.q"},
        "kvcmas.eval.q": {"kvcmas.eval.p"},  # cycle
    }
    assert len(upward_imports(edges)) == 2
    assert cycles(edges) == [["kvcmas.eval.p", "kvcmas.eval.q"]]
    with pytest.raises(AssertionError, match="in no layer"):
        level("newpackage")
