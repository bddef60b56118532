"""Structural fingerprints of transform steps: the key of transformed items.

A step's fingerprint covers its class (module, name, library version) and its
parameters (the instance's attributes; an object with a `__fingerprint__()`
method is keyed by what that returns), and for functions their bytecode,
constants, defaults, closures and the globals they reference, recursively. Two
steps with equal fingerprints compute the same function of their input (given
equal library versions). What cannot be fingerprinted (an open file, a lock, a
C object without state we can read) raises Uncacheable with the path to it:
fail closed, never a random or partial key."""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import struct
import sys
import types
from typing import Any

import numpy as np

MAX_DEPTH = 40
_SCALARS = (type(None), bool, int, float, complex, str, bytes)


class Uncacheable(Exception):
    """A pipeline whose outputs cannot be keyed; the message names the step and why."""


@functools.cache
def library_version(module: str) -> str:
    """Version of the distribution that provides a module ('python-3.11.9' for the
    standard library, '' for code that no installed distribution provides)."""
    top = module.split(".")[0]
    if top in sys.stdlib_module_names or top == "builtins":
        return "python-" + sys.version.split()[0]
    dists = importlib.metadata.packages_distributions().get(top) or []
    for d in dists:
        try:
            return f"{d}-{importlib.metadata.version(d)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return ""


class _Hasher:
    def __init__(self) -> None:
        self.h = hashlib.sha256()
        self.stack: set[int] = set()

    def put(self, tag: str, data: bytes = b"") -> None:
        self.h.update(tag.encode() + struct.pack("<Q", len(data)) + data)

    def value(self, x: Any, path: str, depth: int = 0) -> None:
        if depth > MAX_DEPTH:
            raise Uncacheable(f"{path}: nested deeper than {MAX_DEPTH} levels")
        if isinstance(x, _SCALARS):
            self.put(type(x).__name__, x if isinstance(x, bytes) else repr(x).encode())
            return
        if id(x) in self.stack:  # a cycle: its start is being hashed already
            self.put("cycle")
            return
        self.stack.add(id(x))
        try:
            self._compound(x, path, depth + 1)
        finally:
            self.stack.discard(id(x))

    def _compound(self, x: Any, path: str, d: int) -> None:
        if isinstance(x, (tuple, list)):
            self.put(type(x).__name__, str(len(x)).encode())
            for k, v in enumerate(x):
                self.value(v, f"{path}[{k}]", d)
        elif isinstance(x, dict):
            self.put("dict", str(len(x)).encode())
            for k, v in sorted(x.items(), key=lambda kv: repr(kv[0])):
                self.value(k, path, d)
                self.value(v, f"{path}[{k!r}]", d)
        elif isinstance(x, (set, frozenset)):
            self.put("set", "\0".join(sorted(sub_fingerprint(v, path, d) for v in x)).encode())
        elif isinstance(x, np.ndarray):
            self.put("ndarray", f"{x.dtype.str}{x.shape}".encode() + np.ascontiguousarray(x).tobytes())
        elif isinstance(x, np.generic):
            self.put("npscalar", x.dtype.str.encode() + x.tobytes())
        elif type(x).__module__ == "torch" and hasattr(x, "numel"):
            self.value(x.detach().cpu().numpy(), path, d)
        else:
            self._code_like(x, path, d)

    def _code_like(self, x: Any, path: str, d: int) -> None:
        if isinstance(x, types.ModuleType):
            self.put("module", f"{x.__name__}/{library_version(x.__name__)}".encode())
        elif isinstance(x, types.FunctionType):
            self.function(x, path, d)
        elif isinstance(x, types.MethodType):
            self.put("method")
            self.value(x.__func__, f"{path}.__func__", d)
            self.value(x.__self__, f"{path}.__self__", d)
        elif isinstance(x, (types.BuiltinFunctionType, types.BuiltinMethodType, types.WrapperDescriptorType,
                            types.MethodDescriptorType, np.ufunc)):
            mod = getattr(x, "__module__", None) or type(getattr(x, "__self__", None)).__module__
            self.put("builtin", f"{mod}.{getattr(x, '__qualname__', x.__name__)}/{library_version(mod)}".encode())
        elif isinstance(x, functools.partial):
            self.put("partial")
            self.value(x.func, f"{path}.func", d)
            self.value(x.args, f"{path}.args", d)
            self.value(x.keywords, f"{path}.keywords", d)
        elif isinstance(x, type):
            self.klass(x, path, d)
        elif isinstance(x, types.CodeType):
            self.code(x, path, d)
        else:
            self.instance(x, path, d)

    def function(self, f: types.FunctionType, path: str, d: int) -> None:
        self.put("function", f"{f.__module__}.{f.__qualname__}".encode())
        self.code(f.__code__, f"{path}.__code__", d)
        self.value(f.__defaults__, f"{path}.__defaults__", d)
        self.value(f.__kwdefaults__, f"{path}.__kwdefaults__", d)
        for k, cell in enumerate(f.__closure__ or ()):
            try:
                content = cell.cell_contents
            except ValueError:  # an empty cell (a name bound later)
                content = None
            self.value(content, f"{path}.__closure__[{k}]", d)
        g = f.__globals__
        for name in sorted(_global_names(f.__code__)):
            if name in g:
                self.put("global", name.encode())
                self.value(g[name], f"{path} global {name}", d)

    def code(self, c: types.CodeType, path: str, d: int) -> None:
        self.put("code", c.co_code + repr((c.co_names, c.co_argcount, c.co_kwonlyargcount, c.co_flags)).encode())
        for k, const in enumerate(c.co_consts):
            self.value(const, f"{path}.co_consts[{k}]", d)

    def klass(self, c: type, path: str, d: int) -> None:
        version = library_version(c.__module__)
        self.put("class", f"{c.__module__}.{c.__qualname__}/{version}".encode())
        if version:  # an installed library's class: its name and version stand for its code
            return
        for base in c.__mro__[1:]:
            if base is not object:
                self.value(base, f"{path} base {base.__qualname__}", d)
        for name, member in sorted(vars(c).items()):
            if isinstance(member, (types.FunctionType, staticmethod, classmethod, property)):
                fn = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
                if fn is not None:
                    self.put("member", name.encode())
                    self.value(fn, f"{path}.{name}", d)

    def instance(self, x: Any, path: str, d: int) -> None:
        cls = type(x)
        keyed = getattr(cls, "__fingerprint__", None)
        if keyed is not None:  # keys itself (a TF graph: preprocess/tf_map.py), not by its attributes
            self.put("self-keyed", f"{cls.__module__}.{cls.__qualname__}".encode())
            self.value(keyed(x), f"{path}.__fingerprint__()", d)
            return
        self.klass(cls, f"{path} class", d)
        state = getattr(x, "__dict__", None)
        slots = [s for c in cls.__mro__ for s in getattr(c, "__slots__", ())]
        if state is None and not slots:
            raise Uncacheable(f"{path}: a {cls.__module__}.{cls.__qualname__} has no state that can be "
                              f"fingerprinted (no __dict__ or __slots__)")
        if _is_resource(x):
            raise Uncacheable(f"{path}: a {cls.__qualname__} (an open resource) cannot be fingerprinted")
        self.value(dict(state or {}), f"{path}.__dict__", d)
        for s in slots:
            if hasattr(x, s):
                self.put("slot", s.encode())
                self.value(getattr(x, s), f"{path}.{s}", d)


def _global_names(c: types.CodeType) -> set[str]:
    names = set(c.co_names)
    for const in c.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _is_resource(x: Any) -> bool:
    import io
    import socket
    import threading
    return isinstance(x, (io.IOBase, socket.socket, threading.Thread)) or type(x).__name__ in (
        "lock", "RLock", "Condition", "Event")


def sub_fingerprint(x: Any, path: str = "value", depth: int = 0) -> str:
    h = _Hasher()
    h.value(x, path, depth)
    return h.h.hexdigest()


def fingerprint(x: Any, path: str = "step") -> str:
    """Hex SHA-256 of a value's structure; raises Uncacheable naming what failed."""
    return sub_fingerprint(x, path)
