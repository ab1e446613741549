"""The package's shape (docs/design.md, "Where things live"): file and function sizes, no import
cycles, kernel files holding only ``@triton.jit`` code, no private names shared across files.
Static checks on the source (no imports of the modules checked)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fusedops"
MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 80


def _files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _module(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(rel.parts).removesuffix(".__init__")


def _is_jit(fn: ast.AST) -> bool:
    return any("jit" in ast.unparse(d) for d in getattr(fn, "decorator_list", ()))


def test_no_file_is_too_long():
    long = {str(p.relative_to(PACKAGE)): n for p in _files()
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, long


def test_no_function_is_too_long_outside_kernels():
    long = set()
    for path in _files():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.FunctionDef) and not _is_jit(node)
                    and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES):
                long.add(f"{path.relative_to(PACKAGE)}:{node.name}")
    assert not long, long


def test_kernel_files_hold_only_jit_code():
    for path in sorted((PACKAGE / "backends" / "triton" / "kernels").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                assert _is_jit(node), f"{path.name}: {node.name} is not a @triton.jit function"


EXTENSIONS = {"fusedops._metal_ext", "fusedops._host_ext"}  # (the built extensions)


def test_no_private_names_across_files():
    modules = {_module(p) for p in _files()} | EXTENSIONS
    shared = []
    for path in _files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fusedops"):
                shared += [f"{path.name}: {node.module}.{a.name}" for a in node.names
                           if a.name.startswith("_") and not a.name.startswith("__")
                           and f"{node.module}.{a.name}" not in modules]
    assert not shared, shared


def test_no_import_cycles():
    modules = {_module(p): p for p in _files()}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.parse(path.read_text()).body:  # module-level imports only
            body = node.body if isinstance(node, (ast.If, ast.Try)) else [node]
            for stmt in body:
                if isinstance(stmt, ast.ImportFrom) and (stmt.module or "").startswith("fusedops"):
                    for alias in stmt.names:
                        sub = f"{stmt.module}.{alias.name}"
                        if sub in EXTENSIONS:  # (built from C++: they import nothing of ours)
                            continue
                        target = sub if sub in modules else stmt.module
                        if target in modules and target != name:
                            graph[name].add(target)
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(trail + [node, nxt]))
            if nxt not in state:
                visit(nxt, trail + [node])
        state[node] = 2

    for m in graph:
        if m not in state:
            visit(m, [])
