"""The shape of the code, read with `ast`: the import graph of non-test code has
no loops and runs one way, down the floors below; every project import names a
module of this tree; no function is over 60 lines."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("cacheserver", "manager", "clients", "preprocess")

# Floors, lowest first: a module may import its own floor and those below it,
# never one above. The vocabulary is the ground floor (it imports nothing of
# ours); the cache server and its client library stand on it; the manager uses
# both; the training-side clients and preprocessing use all of them.
FLOORS = (
    ("cacheserver.vocab",),
    ("cacheserver",),
    ("manager",),
    ("clients", "preprocess"),
)
MAX_FUNCTION_LINES = 60


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources(roots: tuple[str, ...]) -> dict[str, pathlib.Path]:
    return {_module_name(p): p for r in roots for p in sorted((ROOT / r).rglob("*.py"))}


MODULES = _sources(PACKAGES)


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """Every project module `name` imports, anywhere in the file (also inside
    functions and `if TYPE_CHECKING:`): `from a import b` counts as a.b when
    that is a module, else as a."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in MODULES]
            out.update(subs)
            if len(subs) < len(node.names):
                out.add(mod)
    return {m for m in out if m.split(".")[0] in PACKAGES}


GRAPH = {name: _imports(name, path) - {name} for name, path in MODULES.items()}


def _floor(module: str) -> int:
    best, floor = -1, -1
    for i, prefixes in enumerate(FLOORS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, floor = len(p), i
    assert floor >= 0, f"{module} stands on no floor: add its package to FLOORS"
    return floor


def _cycle() -> list[str] | None:
    """One import loop, as the modules around it, or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    for start in sorted(GRAPH):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(GRAPH[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state and nxt in GRAPH:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(GRAPH[nxt])))
    return None


def test_the_walker_sees_the_imports():
    # A walker that found nothing would pass every check below.
    assert "cacheserver.vocab" in GRAPH["cacheserver.core"]
    assert "cacheserver.client.server_client" in GRAPH["cacheserver.client.ring_client"]
    assert "manager.manager_client" in GRAPH["clients.coordination"]
    assert _floor("cacheserver.vocab") == 0 and _floor("cacheserver.core") == 1 and _floor("clients.loader") == 3


def test_no_import_loops():
    loop = _cycle()
    assert loop is None, "import loop: " + " -> ".join(loop)


def test_imports_run_down_the_floors():
    upward = [f"{m} -> {d}" for m, deps in sorted(GRAPH.items()) for d in sorted(deps)
              if _floor(d) > _floor(m)]
    assert not upward, "imports of a higher floor:\n" + "\n".join(upward)


def test_every_project_import_names_a_module_of_this_tree():
    # The shared virtualenv's editable install can resolve a module deleted
    # here from another checkout; this catches an import left behind.
    files = dict(MODULES)
    files.update(_sources(("tests",)))
    for p in sorted((ROOT / "tools").rglob("*")):
        if p.is_file() and (p.suffix == ".py" or p.read_bytes()[:30].startswith(b"#!/usr/bin/env python")):
            files[str(p.relative_to(ROOT))] = p
    missing = []
    for name, path in sorted(files.items()):
        for mod in sorted(_imports(name, path)):
            if mod not in MODULES:
                missing.append(f"{path.relative_to(ROOT)}: {mod}")
    assert not missing, "imports of modules this tree lacks:\n" + "\n".join(missing)


def _long_functions(roots: tuple[str, ...]) -> list[str]:
    out = []
    for name, path in sorted(_sources(roots).items()):
        if name.startswith("cacheserver.proto."):
            continue  # generated by tools/gen_proto.py
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                length = node.end_lineno - first + 1
                if length > MAX_FUNCTION_LINES:
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    return out


def test_the_length_check_sees_long_functions(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "pkg" / "m.py").write_text(f"def short():\n    pass\n\n\ndef long():\n{body}\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert _long_functions(("pkg",)) == [f"pkg/m.py:5 long: {MAX_FUNCTION_LINES + 1} lines"]


def test_no_function_is_over_60_lines():
    long = _long_functions(PACKAGES)
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)
