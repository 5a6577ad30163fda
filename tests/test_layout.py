"""The package's layout holds: no import cycle among its modules, imports inside functions
counted, and no module importing another of the package lazily except where it buys start-up
time (the CLI) or keeps an optional dependency optional (the Triton kernels).

Imports are read from the source with `ast`, so nothing is imported and the test is instant.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "depthcurse"
# module -> the package modules it may import inside a function, and why
LAZY_ALLOWED = {
    **{name: None for name in ("depthcurse.cli", "depthcurse.cli.shared", "depthcurse.cli.prune", "depthcurse.cli.heal", "depthcurse.cli.models",
                               "depthcurse.cli.inspect", "depthcurse.cli.train", "depthcurse.cli.select", "depthcurse.cli.speculate",
                               "depthcurse.cli.settings")},  # any: each command imports the library itself, so --help needs no torch
    "depthcurse.train.kernels": {"depthcurse.train.triton_kernels"},  # triton is optional, and its import fixes the mode
}


def _module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        names[name] = path
    return names


MODULES = _module_names()


def _imports(name: str, path: Path) -> list[tuple[str, bool, int]]:
    """(imported package module, imported inside a function?, line) for every import in `path`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found = []

    def add(target: str, lazy: bool, line: int) -> None:
        # The module itself if it is one of ours, else the package holding the imported name.
        while target and target not in MODULES:
            target = target.rpartition(".")[0]
        if target.startswith("depthcurse") and target != name:
            found.append((target, lazy, line))

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    add(alias.name, inner, child.lineno)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: resolve against this module's package
                    anchor = name.split(".")[: len(name.split(".")) - child.level + (1 if is_package else 0)]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in child.names:
                    add(f"{base}.{alias.name}", inner, child.lineno)
            visit(child, inner)

    visit(tree, False)
    return found


def _graph() -> dict[str, set[str]]:
    """module -> the package modules importing it runs: what it names, plus every package on the
    way to them that is not already on its own way (Python runs each package's __init__ first)."""
    graph = {}
    for name, path in MODULES.items():
        edges = set()
        own = {name.rsplit(".", k)[0] for k in range(name.count(".") + 1)}
        for target, _, _ in _imports(name, path):
            edges.add(target)
            parts = target.split(".")
            edges.update(p for p in (".".join(parts[:k]) for k in range(1, len(parts))) if p not in own)
        graph[name] = edges - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_the_package_has_no_import_cycle():
    assert len(MODULES) > 20
    assert _cycles(_graph()) == []


def test_package_imports_sit_at_the_top_of_modules():
    lazy = []
    for name, path in MODULES.items():
        allowed = LAZY_ALLOWED.get(name, set())
        for target, inner, line in _imports(name, path):
            if inner and allowed is not None and target not in allowed:
                lazy.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target} inside a function")
    assert lazy == []


def test_the_checks_see_a_cycle_and_a_lazy_import(tmp_path, monkeypatch):
    """The checks above can fail: a two-module loop, one half of it lazy, is reported."""
    pkg = tmp_path / "depthcurse"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from depthcurse import b\n")
    (pkg / "b.py").write_text("def f():\n    from depthcurse.a import thing\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    monkeypatch.setattr(sys.modules[__name__], "MODULES", _module_names())
    assert _cycles(_graph()) == [["depthcurse.a", "depthcurse.b"]]
    with pytest.raises(AssertionError, match="b.py:2 imports depthcurse.a inside a function"):
        test_package_imports_sit_at_the_top_of_modules()


def test_the_commands_import_only_the_shared_cli_and_the_library():
    """A family of commands never imports another: what two share lives in `cli.shared` or below."""
    # options_table is no family: it makes docs/commands.md's table of every option from them all
    commands = [name for name in MODULES if name.startswith("depthcurse.cli.") and name not in ("depthcurse.cli.shared", "depthcurse.cli.options_table")]
    assert len(commands) >= 5
    crossing = [f"{name} imports {target}" for name in commands for target, _, _ in _imports(name, MODULES[name])
                if target.startswith("depthcurse.cli") and target != "depthcurse.cli.shared"]
    assert crossing == []
