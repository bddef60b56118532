"""Counters are declared: an undeclared name raises, and every name the code adds is declared."""
import ast
import pathlib

import pytest

from cacheserver.counters import SERVER_COUNTERS, Counters, UndeclaredCounter
from manager.metrics import MANAGER_COUNTERS

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_an_undeclared_counter_raises_and_changes_nothing():
    c = Counters(("hits", "misses"))
    c.add("hits")
    c.add_many({"hits": 2, "misses": 1})
    assert c.snapshot() == {"hits": 3, "misses": 1}
    with pytest.raises(UndeclaredCounter, match="counter 'hitz' is not declared"):
        c.add("hitz")
    with pytest.raises(UndeclaredCounter, match="'mises'"):
        c.add_many({"hits": 1, "mises": 1})
    with pytest.raises(UndeclaredCounter):
        c["hitz"]
    assert c.snapshot() == {"hits": 3, "misses": 1}  # a refused add_many adds nothing


def _added_names(package: str) -> set[str]:
    """Counter names written as literals in `.add("x")` and `.add_many({"x": ...})` calls."""
    names = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args):
                continue
            arg = node.args[0]
            if node.func.attr == "add" and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names.add(arg.value)
            elif node.func.attr == "add_many" and isinstance(arg, ast.Dict):
                names.update(k.value for k in arg.keys if isinstance(k, ast.Constant))
    return names


def test_every_counter_the_code_adds_is_declared():
    server = _added_names("cacheserver")
    manager = _added_names("manager")
    assert {"lookups", "bad_requests", "flushes"} <= server and {"server_calls", "reconciles"} <= manager
    assert server - set(SERVER_COUNTERS) == set()
    assert manager - set(MANAGER_COUNTERS) == set()
