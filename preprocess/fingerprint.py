"""Structural fingerprints of transform steps: the key of transformed items.

A step's fingerprint covers its class (module, name, library version; for a
class of no installed library, or of an editable install, whose code changes under
one version, also its methods and plain class attributes) and
its parameters (the instance's attributes; an object with a `__fingerprint__()`
method is keyed by what that returns; a bound method's object; a tensor's or an
array's data; a subclass of a builtin container or of ndarray also by its class and
what it holds besides its items: a defaultdict's default_factory, an OrderedDict's
order (of 2 items or more), a masked array's mask and fill value, instance
attributes), and for
functions their bytecode (with the argument names and, from 3.11, the exception
table), constants, defaults, attributes, closures and the globals they reference,
recursively (a user's own module by its source file and the attributes the code
names). A string or path that names a regular file here adds the file's content (a
step may read it when it runs: a vocabulary, a mean/std table); one whose name the step
builds at run time is declared with the step's `reads` (reads.py). Two steps with equal fingerprints compute the same function of
their input (given equal library versions). What cannot be fingerprinted (an open
file, a lock, a C object without state we can read) raises Uncacheable with the
path to it: fail closed, never a random or partial key."""
from __future__ import annotations

import collections
import functools
import hashlib
import importlib.metadata
import os
import re
import stat
import struct
import sys
import time
import types
from typing import Any

import numpy as np

MAX_DEPTH = 40
FILE_HASH_LIMIT = 256 << 20  # a named file larger than this is keyed by size and mtime, not hashed
RACY_S = 2.0  # a file's hash is remembered once it has not changed for this long
_FILE_KEYS: dict[tuple, bytes] = {}  # (file, its stat) -> its key part
_SCALARS = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis), type(NotImplemented))  # x[..., 0]
_BUILTINS = (types.BuiltinFunctionType, types.BuiltinMethodType, types.WrapperDescriptorType,
             types.MethodDescriptorType, types.MethodWrapperType, np.ufunc)
# Containers keyed by their items alone (a subclass adds its class and state: container_subclass).
_PLAIN_CONTAINERS = (tuple, list, dict, set, frozenset)
# Class attributes that are bookkeeping, not parameters: ABCs' registry cache (a C
# object), slot descriptors and namedtuple field getters (the fields are in _fields).
_CLASS_BOOKKEEPING = frozenset({"_abc_impl"})
_FIELD_DESCRIPTORS = (types.MemberDescriptorType, types.GetSetDescriptorType) + tuple(
    t for t in (getattr(collections, "_tuplegetter", None),) if t is not None)


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
            dist = importlib.metadata.distribution(d)
        except importlib.metadata.PackageNotFoundError:
            continue
        # an editable install's version does not stand for its code (edited in place): keyed as a user's
        return f"{d}-{dist.version}" if _installed_copy(dist, module) else ""
    return ""


def _installed_copy(dist: importlib.metadata.Distribution, module: str) -> bool:
    """Is the loaded module's file the distribution's installed copy, beside its metadata and
    not in a project's tree? An editable install (pip install -e) puts the metadata in
    site-packages and leaves the code in the project, or (setup.py develop) puts an .egg-info
    in the project beside its pyproject.toml/setup.py: either is edited under one version."""
    file = getattr(sys.modules.get(module), "__file__", None)
    if file is None:  # not loaded, or no file of its own (a namespace package): as its version says
        return True
    try:
        root = os.path.realpath(dist.locate_file(""))
    except (NotImplementedError, TypeError, ValueError):  # a finder's distribution without files on disk
        return True
    path = os.path.realpath(file)
    if os.path.commonpath([root, path]) != root:
        return False
    return not any(os.path.exists(os.path.join(root, f)) for f in ("pyproject.toml", "setup.py", "setup.cfg"))


class _Hasher:
    def __init__(self) -> None:
        self.h = hashlib.sha256()
        self.stack: set[int] = set()
        self.files: set[str] = set()  # the regular files keyed by their content (reads.unkeyed)

    def put(self, tag: str, data: bytes = b"") -> None:
        self.h.update(tag.encode() + struct.pack("<Q", len(data)) + data)

    def value(self, x: Any, path: str, depth: int = 0) -> None:
        try:
            self._value(x, path, depth)
        except (Uncacheable, RecursionError):
            raise
        except Exception as e:  # a value whose own methods fail (an odd tensor, a C object): refuse, never crash
            raise Uncacheable(f"{path}: cannot be fingerprinted ({type(e).__name__}: {e})") from e

    def _value(self, x: Any, path: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise Uncacheable(f"{path}: nested deeper than {MAX_DEPTH} levels")
        if isinstance(x, _SCALARS):
            self.put(type(x).__name__, x if isinstance(x, bytes) else repr(x).encode())
            if isinstance(x, str):
                self.file(x, path)
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
        if isinstance(x, (tuple, list, dict, set, frozenset)):
            self.container(x, path, d)
        elif isinstance(x, np.ndarray):
            self.array(x, path, d)
        elif isinstance(x, np.generic):
            self.put("npscalar", _dtype_tag(x.dtype).encode() + x.tobytes())
        elif isinstance(x, np.dtype):
            self.put("npdtype", _dtype_tag(x).encode())
        elif isinstance(x, (slice, range)):  # C objects without __dict__: their three fields are all their state
            self.put(type(x).__name__)
            self.value((x.start, x.stop, x.step), path, d)
        elif isinstance(x, re.Pattern):  # a C object without __dict__: its pattern and flags are all its state
            self.put("regex")
            self.value((x.pattern, x.flags), path, d)
        elif isinstance(x, os.PathLike):  # a pathlib path: by what it names (its slots cache str(), lazily)
            name = os.fsdecode(os.fspath(x))
            self.put("pathlike", f"{type(x).__module__}.{type(x).__qualname__}:{name}".encode())
            self.file(name, path)
        elif _torch_kind(x) == "tensor":
            self.tensor(x, path, d)
        elif _torch_kind(x) == "descriptor":  # torch.float32, torch.device("cpu"): named by their str
            self.put(f"torch.{type(x).__name__}", str(x).encode())
        else:
            self._code_like(x, path, d)

    def file(self, name: str, path: str) -> None:
        """A string (or path) that names a regular file here: the file's content is keyed too,
        since a step may read it when it runs (a vocabulary, a mean/std table); a changed
        file must not serve outputs made with the old one. Directories are not followed."""
        if not name or len(name) > 4096 or "\0" in name or "\n" in name:
            return
        try:
            st = os.stat(name)
        except (OSError, ValueError):
            return  # names no file here: keyed as the string it is
        if stat.S_ISREG(st.st_mode):
            self.put("file", _file_key(name, st, path))
            self.files.add(name)

    def container(self, x: tuple | list | dict | set | frozenset, path: str, d: int) -> None:
        if isinstance(x, (tuple, list)):
            self.put(type(x).__name__, str(len(x)).encode())
            for k, v in enumerate(x):
                self.value(v, f"{path}[{k}]", d)
        elif isinstance(x, dict):
            self.put("dict", str(len(x)).encode())
            for k, v in _dict_items(x, path, d):
                self.value(k, path, d)
                self.value(v, f"{path}[{k!r}]", d)
        else:
            self.put("set", "\0".join(sorted(sub_fingerprint(v, path, d) for v in x)).encode())
        if type(x) not in _PLAIN_CONTAINERS and not _short_ordered_dict(x):
            self.container_subclass(x, path, d)

    def container_subclass(self, x: Any, path: str, d: int) -> None:
        """What a subclass of a builtin container adds to its items (after them: a plain
        container's key stays as it was, so items cached under it stay valid): its class
        (methods it overrides; Counter is not a dict), an OrderedDict's order (part of its
        value: == compares it), a defaultdict's default_factory, its instance attributes."""
        self.put("container-subclass")
        self.value(type(x), f"{path} class", d)
        if isinstance(x, collections.OrderedDict):
            self.value(list(x), f"{path} order", d)
        if isinstance(x, collections.defaultdict):
            self.value(x.default_factory, f"{path}.default_factory", d)
        self.attributes(x, type(x), path, d)

    def array(self, x: np.ndarray, path: str, d: int) -> None:
        if x.dtype.hasobject:
            # tobytes() of an object array is its elements' addresses (different in every process)
            self.put("ndarray-objects", f"{_dtype_tag(x.dtype)}{x.shape}".encode())
            self.value(x.ravel().tolist(), f"{path}.flat", d)
        else:
            self.put("ndarray", f"{_dtype_tag(x.dtype)}{x.shape}".encode() + np.ascontiguousarray(x).tobytes())
        if type(x) in (np.ndarray, np.memmap):  # a memmap's own state says where its bytes are, not what
            return
        # a subclass (after the data: a plain array's key stays as it was): its class (np.matrix's
        # * is a matrix product), a masked array's mask and fill, others' instance attributes
        self.put("ndarray-subclass")
        self.value(type(x), f"{path} class", d)
        if isinstance(x, np.ma.MaskedArray):
            # _fill_value: None until set; the fill_value property would set it (and fails on np.ma.masked)
            fill = getattr(x, "_fill_value", None)
            self.value((np.ma.getmaskarray(x), fill, x.hardmask, x.baseclass), f"{path}.mask", d)
        else:
            self.attributes(x, type(x), path, d)

    def _code_like(self, x: Any, path: str, d: int) -> None:
        if isinstance(x, types.ModuleType):
            self.module(x, path)
        elif isinstance(x, types.FunctionType):
            self.function(x, path, d)
        elif isinstance(x, types.MethodType):
            self.put("method")
            self.value(x.__func__, f"{path}.__func__", d)
            self.value(x.__self__, f"{path}.__self__", d)
        elif isinstance(x, _BUILTINS):
            owner = getattr(x, "__self__", None)
            mod = getattr(x, "__module__", None) or type(owner).__module__
            self.put("builtin", f"{mod}.{getattr(x, '__qualname__', x.__name__)}/{library_version(mod)}".encode())
            # a method bound to an object ({...}.get, a compiled regex's .sub): the object is a parameter.
            # A library module's function (len, math.sqrt) is named by the module's version above.
            if owner is not None and not (isinstance(owner, types.ModuleType) and library_version(owner.__name__)):
                self.value(owner, f"{path}.__self__", d)
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
        if f.__dict__:  # attributes the code may read (scale.factor = 2); none: the key stays as it was
            self.value(dict(f.__dict__), f"{path}.__dict__", d)
        g = f.__globals__
        names = _global_names(f.__code__)
        for name in sorted(names):
            if name in g:
                self.put("global", name.encode())
                self.value(g[name], f"{path} global {name}", d)
                if isinstance(g[name], types.ModuleType):
                    self.module_attributes(g[name], names, f"{path} global {name}", d, set())

    def module(self, m: types.ModuleType, path: str) -> None:
        version = library_version(m.__name__)
        self.put("module", f"{m.__name__}/{version}".encode())
        if version:  # the standard library or an installed distribution: name and version stand for its code
            return
        # A user's own module (no distribution provides it): it can be edited under the same name
        # and version, so its file's bytes are in the key (a comment edit costs a miss, never a
        # stale hit). Its submodules and re-exports are reached by module_attributes.
        spec = getattr(m, "__spec__", None)
        file = getattr(m, "__file__", None)
        if file is None and spec is not None and spec.submodule_search_locations is not None:
            return  # a namespace package: no code of its own
        try:
            if file is None:
                raise OSError("it has no file")
            with open(file, "rb") as fh:
                self.put("module-source", hashlib.sha256(fh.read()).digest())
        except OSError as e:
            raise Uncacheable(f"{path}: module {m.__name__} is no installed library's and its source "
                              f"cannot be read ({e})") from None

    def module_attributes(self, m: types.ModuleType, names: set[str], path: str, d: int, seen: set[int]) -> None:
        """The attributes of a user's module that a function may use (myhelpers.scale,
        pkg.sub.fn): every name the code mentions that the module defines, followed
        into submodules; libraries are keyed by version instead."""
        if id(m) in seen or library_version(m.__name__):
            return
        seen.add(id(m))
        attrs = vars(m)
        for name in sorted(names & attrs.keys()):
            self.put("attribute", f"{m.__name__}.{name}".encode())
            self.value(attrs[name], f"{path}.{name}", d)
            if isinstance(attrs[name], types.ModuleType):
                self.module_attributes(attrs[name], names, f"{path}.{name}", d, seen)

    def tensor(self, x: Any, path: str, d: int) -> None:
        """A torch tensor (nn.Parameter and other subclasses too) by its type, dtype,
        shape and bytes: a byte view, as numpy has no bfloat16 (nor float8)."""
        import torch  # loaded: x is one of its tensors
        self.value(type(x), f"{path} class", d)
        if x.is_quantized or x.layout != torch.strided:  # their bytes are not all their state
            kind = "quantized" if x.is_quantized else str(x.layout)
            raise Uncacheable(f"{path}: a {kind} tensor cannot be fingerprinted")
        t = x.detach().cpu().resolve_conj().resolve_neg().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        self.put("tensor", f"{t.dtype}{tuple(t.shape)}".encode() + raw)
        extra = getattr(x, "__dict__", None)  # attributes set on the tensor or a subclass's state
        if extra:
            self.value(dict(extra), f"{path}.__dict__", d)

    def code(self, c: types.CodeType, path: str, d: int) -> None:
        self.put("code", c.co_code + repr((c.co_names, c.co_argcount, c.co_kwonlyargcount, c.co_flags)).encode())
        # outside co_code but part of what runs: the names arguments bind by (a partial's keywords,
        # which of them are positional-only) and, from 3.11, which instructions a try covers
        self.put("code-binding", repr((c.co_varnames, c.co_posonlyargcount)).encode()
                 + getattr(c, "co_exceptiontable", b""))
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
            elif isinstance(member, functools.cached_property):
                self.put("member", name.encode())
                self.value(member.func, f"{path}.{name}", d)
            elif _is_class_parameter(name, member):  # FACTOR = 2: read by the methods, so part of the behaviour
                self.put("class-attribute", name.encode())
                self.value(member, f"{path}.{name}", d)

    def instance(self, x: Any, path: str, d: int) -> None:
        cls = type(x)
        keyed = getattr(cls, "__fingerprint__", None)
        if keyed is not None:  # keys itself (a TF graph: preprocess/tf_map.py), not by its attributes
            self.put("self-keyed", f"{cls.__module__}.{cls.__qualname__}".encode())
            self.value(keyed(x), f"{path}.__fingerprint__()", d)
            return
        self.value(cls, f"{path} class", d)  # through value(): a class attribute holding an instance is a cycle
        if getattr(x, "__dict__", None) is None and not _slot_names(cls):
            raise Uncacheable(f"{path}: a {cls.__module__}.{cls.__qualname__} has no state that can be "
                              f"fingerprinted (no __dict__ or __slots__)")
        if _is_resource(x):
            raise Uncacheable(f"{path}: a {cls.__qualname__} (an open resource) cannot be fingerprinted")
        self.attributes(x, cls, path, d, always=True)

    def attributes(self, x: Any, cls: type, path: str, d: int, always: bool = False) -> None:
        """An object's instance attributes: its __dict__ (always=True: also when it has
        none, as an instance's key always had) and its slots."""
        state = getattr(x, "__dict__", None)
        if state is not None and _torch_kind(x) == "module":
            state = _hooks_renumbered(state)
        if state is not None or always:
            self.value(dict(state or {}), f"{path}.__dict__", d)
        for s in _slot_names(cls):
            if hasattr(x, s):
                self.put("slot", s.encode())
                self.value(getattr(x, s), f"{path}.{s}", d)


_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


def _file_key(name: str, st: os.stat_result, path: str) -> bytes:
    """SHA-256 of a file's bytes; over FILE_HASH_LIMIT, its size and mtime (a cheap proxy:
    a huge file is named by a step to read parts of it, and hashing it would stall the
    loader). Remembered per (file, size, mtime, ctime) once it is older than RACY_S: a
    rewrite within the file system's clock tick could keep both (git's racy-clean case)."""
    if st.st_size > FILE_HASH_LIMIT:
        return b"stat" + struct.pack("<Qq", st.st_size, st.st_mtime_ns)
    k = (os.path.realpath(name), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if k in _FILE_KEYS:
        return _FILE_KEYS[k]
    h = hashlib.sha256()
    try:
        with open(name, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    except OSError as e:
        raise Uncacheable(f"{path}: names the file {name!r}, whose content is part of the key (a step may "
                          f"read it) but cannot be read ({e})") from None
    key = b"sha256" + h.digest()
    if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > RACY_S * 1e9:
        _FILE_KEYS[k] = key
    return key


def _dict_items(x: dict, path: str, d: int) -> list[tuple[Any, Any]]:
    """A dict's items in an order that does not depend on the process: by their keys' repr
    less memory addresses (an object's default repr names its address, which made one
    mapping's key differ from process to process), ties by the keys' and values'
    fingerprints. A dict whose keys' reprs hold no address keeps its order, and its key."""
    names = [_ADDRESS.sub("0x", repr(k)) for k in x]
    if len(set(names)) == len(names):
        return [kv for _, kv in sorted(zip(names, x.items()), key=lambda t: t[0])]
    return [kv for _, kv in sorted(zip(names, x.items()), key=lambda t: (
        t[0], sub_fingerprint(t[1][0], path, d), sub_fingerprint(t[1][1], path, d)))]


def _short_ordered_dict(x: Any) -> bool:
    """An OrderedDict of fewer than 2 items and no attributes: equal to the dict of its items
    and iterated alike, so keyed as that dict. (Torch modules hold empty ones for their
    hooks: their keys stay as they were.)"""
    return type(x) is collections.OrderedDict and len(x) < 2 and not vars(x)


def _slot_names(cls: type) -> list[str]:
    """The slots of a class and its bases; `__slots__ = "name"` is one slot, not one per
    letter. (Read with getattr, as before: a base's slots come again for a subclass that
    declares none, which changes nothing but keeps such instances' keys as they were.)"""
    out: list[str] = []
    for c in cls.__mro__:
        slots = getattr(c, "__slots__", ())
        out += [slots] if isinstance(slots, str) else list(slots)
    return out


def _global_names(c: types.CodeType) -> set[str]:
    names = set(c.co_names)
    for const in c.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _dtype_tag(dt: np.dtype) -> str:
    # .str of a structured dtype is only its width ('|V16'): the fields tell how the bytes are read
    return dt.str if dt.names is None else f"{dt.str}{dt.descr}"


def _torch_kind(x: Any) -> str:
    torch = sys.modules.get("torch")  # never imported here: a torch object means torch is loaded
    if torch is None:
        return ""
    if isinstance(x, torch.Tensor):
        return "tensor"
    if isinstance(x, (torch.dtype, torch.device)):
        return "descriptor"
    return "module" if isinstance(x, torch.nn.Module) else ""


@functools.lru_cache(maxsize=1)
def _torch_hook_tables() -> frozenset[str]:
    """The names of torch's own hook tables on a module (a user's attribute named "...hooks"
    is keyed as it stands: renumbering its keys would give other values one key)."""
    torch = sys.modules["torch"]
    return frozenset(k for k, v in vars(torch.nn.Module()).items() if "hooks" in k and isinstance(v, dict))


def _hooks_renumbered(state: dict[str, Any]) -> dict[str, Any]:
    """A torch module's state with its hooks keyed by their order of registration: torch keys
    them by a process-wide counter of handles, so the same module built again (or after other
    hooks elsewhere) would get another key each time. A module without hooks keeps its key."""
    own = _torch_hook_tables()
    tables = {k: v for k, v in state.items() if k in own and type(v) in (dict, collections.OrderedDict)}
    ids = sorted({h for t in tables.values() for h in t if isinstance(h, int)})
    if not ids:
        return state
    rank = {h: n for n, h in enumerate(ids)}
    return {**state, **{k: type(t)((rank.get(h, h), v) for h, v in t.items()) for k, t in tables.items()}}


def _is_class_parameter(name: str, member: Any) -> bool:
    """A plain class attribute: not a dunder (__module__, __doc__, dataclass and typing
    bookkeeping), not a slot descriptor, not a namedtuple field getter."""
    dunder = name.startswith("__") and name.endswith("__")
    return not dunder and name not in _CLASS_BOOKKEEPING and not isinstance(member, _FIELD_DESCRIPTORS)


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


def keyed_files(x: Any, path: str = "step") -> set[str]:
    """The regular files whose content x's fingerprint covers (named among its values)."""
    h = _Hasher()
    h.value(x, path)
    return h.files


def fingerprint(x: Any, path: str = "step") -> str:
    """Hex SHA-256 of a value's structure; raises Uncacheable naming what failed."""
    return sub_fingerprint(x, path)
