"""Files a step reads, for its fingerprint (docs/preprocess.md, "Fingerprints").

The fingerprint keys a file by its content only where it sees the file's name among
a step's parameters, constants or globals. A step that builds the name at run time
(a directory joined with a name, a glob) reads files it cannot see: changing them
would leave cached transformed items stale. So:

- a step declares such inputs: `step(fn, reads=[...])`, or a `reads` attribute of the
  callable: files and directories (followed: every regular file under one, by its
  path and content) whose content enters the step's key. Each must exist when the
  pipeline is keyed (fail closed: Uncacheable naming it).
- while the steps run on the sample items before the first epoch (in the loader's own
  process), an audit hook (sys.addaudithook, the "open" event: open(), os.open,
  numpy, PIL and torch loads alike) notes the files each step opens for reading; a
  file neither its fingerprint nor its `reads` covers is warned about, naming the step
  and the file. The hook is installed once and does nothing outside those runs."""
from __future__ import annotations

import contextlib
import os
import site
import sys
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from .fingerprint import Uncacheable, _file_key, keyed_files
from .stall import bound

_lock = threading.Lock()
_active: list[dict[int, set[str]]] = []  # recordings in progress: step -> files it opened to read
_installed = False
_CODE_SUFFIXES = (".py", ".pyc", ".pyi", ".so", ".pth", ".pyd")


def declared(value: Any, where: str) -> tuple[str, ...]:
    """A step's `reads` as a tuple of paths: one path (str, os.PathLike) or an iterable of
    them; anything else is a TypeError naming the step (`where`) and the value."""
    if value is None:
        return ()
    items = [value] if isinstance(value, (str, bytes, os.PathLike)) else value
    try:
        paths = tuple(os.fsdecode(os.fspath(p)) for p in items)
    except TypeError:
        raise TypeError(f"{where}: reads= must be a path (str or os.PathLike) or a list of paths, "
                        f"got {value!r}") from None
    if any(not p for p in paths):
        raise TypeError(f"{where}: reads= holds an empty path: {value!r}")
    return paths


def inputs_key(paths: Iterable[str], where: str) -> list[tuple[str, list[tuple[str, bytes]]]]:
    """The key part of declared inputs: per path, its regular files (relative names, sorted)
    with their contents' keys; a path that is missing, or neither a file nor a directory,
    raises Uncacheable naming it."""
    out = []
    for p in paths:
        files = _files(p, where)
        out.append((p, [(os.path.relpath(f, p) if f != p else "", _file_key(f, os.stat(f), where))
                        for f in files]))
    return out


def _files(p: str, where: str) -> list[str]:
    try:
        st = os.stat(p)
    except OSError as e:
        raise Uncacheable(f"{where}: reads= names {p!r}, which cannot be read here ({e.strerror}); a declared "
                          "input's content is part of the key") from None
    if os.path.isfile(p):
        return [p]
    if not os.path.isdir(p):
        raise Uncacheable(f"{where}: reads= names {p!r}, neither a file nor a directory (mode {st.st_mode:o})")
    out = []
    for root, dirs, names in os.walk(p, onerror=_raise):
        dirs.sort()
        out += [f for f in (os.path.join(root, n) for n in sorted(names)) if os.path.isfile(f)]
    return out


def _raise(e: OSError) -> None:
    raise Uncacheable(f"reads=: a declared directory cannot be listed ({e})")


def _hook(event: str, args: tuple) -> None:
    if event != "open" or not _active:
        return
    try:
        path, mode, flags = args
        slot = bound()
        if slot is None or not slot.by_context or path is None or isinstance(path, int):
            return  # only the sample's runs (their slots name items by context), and named files
        j = slot.step()
        if j < 0 or not _reading(mode, flags):
            return
        name = os.path.abspath(os.fsdecode(os.fspath(path)))
        with _lock:
            for rec in _active:
                rec.setdefault(j, set()).add(name)
    except Exception:  # noqa: S110 (a hook must never fail the open it watches)
        pass


def _reading(mode: Any, flags: Any) -> bool:
    if isinstance(mode, str):
        return "r" in mode or "+" in mode
    return isinstance(flags, int) and flags & os.O_ACCMODE != os.O_WRONLY


@contextlib.contextmanager
def recording() -> Iterator[dict[int, set[str]]]:
    """The files the steps open for reading while the block runs, by step (written position)."""
    global _installed
    rec: dict[int, set[str]] = {}
    with _lock:
        if not _installed:
            sys.addaudithook(_hook)  # for good (hooks cannot be removed): idle but for a list check
            _installed = True
        _active.append(rec)
    try:
        yield rec
    finally:
        with _lock:
            _active.remove(rec)


def unkeyed(pipeline: Any, opened: dict[int, set[str]]) -> dict[int, list[str]]:
    """Per step, the data files it opened that neither its fingerprint nor its `reads` covers
    (code, the interpreter's and installed libraries' files, /proc, /dev are left out)."""
    skip = _system_dirs()
    out: dict[int, list[str]] = {}
    for j, names in sorted(opened.items()):
        files = [n for n in names if not n.endswith(_CODE_SUFFIXES) and not _under(n, skip) and os.path.isfile(n)]
        if not files:
            continue
        s = pipeline.steps[j]
        try:
            seen = {os.path.realpath(f) for f in keyed_files(s.fn, s.name)}
        except Uncacheable:
            continue  # the pipeline is not keyed at all: nothing can go stale
        dirs = tuple(os.path.realpath(p) for p in s.reads)
        missed = sorted(f for f in files if os.path.realpath(f) not in seen
                        and not _under(os.path.realpath(f), dirs))
        if missed:
            out[j] = missed
    return out


def _under(name: str, dirs: Iterable[str]) -> bool:
    return any(name == d or name.startswith(d.rstrip(os.sep) + os.sep) for d in dirs)


def _system_dirs() -> tuple[str, ...]:
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, "/proc", "/sys", "/dev"}
    with contextlib.suppress(Exception):
        dirs.update(site.getsitepackages() + [site.getusersitepackages()])
    return tuple(os.path.realpath(d) for d in dirs if d)
