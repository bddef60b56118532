"""Where ``tools/digest`` reads from: a local path or fsspec URL opened, its data files
listed in order (names as the store means them: an HTTP listing's are percent-decoded),
and the errors both can meet."""

from __future__ import annotations

import errno
import fnmatch
import os
import re
import stat
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple
from urllib.parse import unquote

from clients.digest_paths import path_problem, url_quoted
from clients.digest_work import progress, waiting


class ToolError(Exception):
    """A runtime failure, reported as 'digest: error: ...' with exit code 1."""


class SourceFile(NamedTuple):
    path: str  # as the filesystem names it
    rel: str  # relative to the root, '/'-separated
    size: int | None  # from the listing; None when the backend does not say


def is_local(fs: Any) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


# -- source access -------------------------------------------------------------


_CHAIN_HEAD = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)(?:::|://)")


def _local_path(url: str) -> str | None:
    """The local path `url` is where fsspec would read its '::' as a chain of URLs
    ('/data/x::y' as '/data/x', a digest's 'file:///data/x::y' too); None where fsspec
    reads it as meant. A chain starts with a protocol: one that is also a local path
    is refused as ambiguous."""
    if "::" not in url:
        return None
    if url.startswith("file://"):  # local: nothing chains inside the local filesystem
        return url[len("file://"):]
    from fsspec.registry import known_implementations

    head = _CHAIN_HEAD.match(url)
    if head is None or head.group(1) not in known_implementations:
        return url
    if os.path.lexists(url):
        raise ToolError(f"{url!r} is both a local path and an fsspec URL chain ({head.group(1)}::...): "
                        f"pass ./{url} or its absolute path for the local one")
    return None


def _http_base(fs: Any, base: str) -> str:
    """An HTTP(S) root as its listing spells it: 'http://h/my dir' lists as 'http://h/my%20dir/...'."""
    if not url_quoted(fs):
        return base
    import yarl

    return str(yarl.URL(base))


def open_source(url: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    """``(fs, base)`` for a local path or fsspec URL, with clear errors."""
    import fsspec

    try:
        local = _local_path(url)
        if local is not None:
            fs = fsspec.filesystem("file", **storage_options)
            return fs, (fs._strip_protocol(local).rstrip("/") or "/")
        fs, base = fsspec.core.url_to_fs(url, **storage_options)
        base = _http_base(fs, base)
    except ImportError as e:
        hint = "install the fsspec backend, e.g. gcsfs for gs://"
        raise ToolError(f"cannot open {url}: {e} ({hint})") from None
    except (ValueError, TypeError) as e:
        raise ToolError(f"cannot open {url}: {e}") from None
    return fs, (base.rstrip("/") or base)


def _not_a_file(path: str, info: Mapping[str, Any]) -> str | None:
    """Why a listed entry that fsspec does not call a file cannot be read, or
    None for a symlink to a regular file (read through the link)."""
    if not info.get("islink"):
        return f"not a regular file ({info.get('type')})"
    try:
        st = os.stat(path)  # fsspec reports links only on the local filesystem
    except OSError as e:  # a loop is no broken link: its target names exist
        return "a symlink loop" if e.errno == errno.ELOOP else "a broken symlink"
    if stat.S_ISREG(st.st_mode):
        return None
    return "a symlink to a directory (not followed)" if stat.S_ISDIR(st.st_mode) else "a symlink to a special file"


def _check_utf8(rel: str) -> None:
    """A digest stores UTF-8 paths; a local name that is not UTF-8 (kept by Python as
    surrogates) would fail only when the digest is written, after all the hashing."""
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        raw = rel.encode("utf-8", "surrogateescape")
        raise ToolError(f"cannot digest {raw!r}: its name is not valid UTF-8; rename it "
                        "or pass --exclude") from None


def _check_entry(rel: str) -> None:
    """A name the digest would refuse as an entry (a backslash makes '\\x' absolute and
    '..\\x' escaping, as a Windows reader would take them), refused before the hashing,
    not by DigestBuilder after it."""
    why = path_problem(rel)
    if why:
        raise ToolError(f"cannot digest {rel!r}: as a digest path it {why}; rename it or pass --exclude")


def _url_name(rel: str, src: str) -> str:
    """The name an HTTP listing's relative URL stands for ('a%20b.jpg': 'a b.jpg'): what a
    local, gs:// or s3:// digest of the same files records, so the paths, their order and
    the fingerprint do not depend on the store; reads quote it back (digest_paths.store_path)."""
    names = []
    for part in rel.split("/"):
        try:
            name = unquote(part, errors="strict")
        except UnicodeDecodeError:
            raise ToolError(f"cannot digest {rel!r} under {src}: its name is not UTF-8 once "
                            "percent-decoded") from None
        if "/" in name:
            raise ToolError(f"cannot digest {rel!r} under {src}: its name holds an encoded '/' "
                            "(%2F), which a digest path cannot tell from a directory")
        names.append(name)
    return "/".join(names)


def _local_listing(base: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(path, info) of each entry but directories under the local directory `base`, as
    fs.find(base, detail=True) gives them, without find's info dict per file held to the
    end: about 600 bytes a file, most of the tool's memory on millions of small files.
    A directory that cannot be listed comes as type "unlisted" (find skips it: its
    files would be missing from the digest unnoticed)."""
    todo = [base]
    while todo:
        where = todo.pop()
        try:
            it = os.scandir(where)
        except FileNotFoundError:  # gone since listed
            continue
        except OSError as e:
            yield where, {"type": "unlisted", "error": e.strerror or str(e)}
            continue
        with it:
            for e in it:
                try:
                    if e.is_dir(follow_symlinks=False):
                        todo.append(e.path)
                        continue
                    link, size = e.is_symlink(), e.stat(follow_symlinks=False).st_size
                except FileNotFoundError:  # gone since listed
                    continue
                if link:
                    try:
                        size = e.stat().st_size
                    except OSError:
                        size = 0
                kind = "file" if e.is_file(follow_symlinks=False) else "other"
                yield e.path, {"type": kind, "islink": link, "size": size}


def _listing(fs: Any, base: str, src: str, bar: Any) -> tuple[str, Iterable[tuple[str, Mapping[str, Any]]]]:
    """(root, (path, info) of each entry under it): SRC's files, or SRC and its directory;
    `bar` (a progress bar) redrawn while a remote store lists (minutes, on millions)."""
    if is_local(fs) and os.path.isdir(base):
        return base, _local_listing(base)
    try:
        found = waiting(bar, lambda: fs.find(base, detail=True))
    except FileNotFoundError:
        raise ToolError(f"source not found: {src}") from None
    except Exception as e:  # network / permission errors of any backend
        raise ToolError(f"cannot list {src}: {type(e).__name__}: {e}") from None
    if list(found) == [base]:  # SRC is one file: its directory is the root
        return fs._parent(base), found.items()
    return base, found.items()


def _check_unlisted(path: str, prefix: str, error: str, excludes: Sequence[str], src: str) -> None:
    """Refuse a local directory that cannot be listed, unless --exclude covers its files."""
    if not path.startswith(prefix):  # SRC itself
        raise ToolError(f"cannot list {src}: {error}")
    rel = path[len(prefix):]
    if any(fnmatch.fnmatchcase(rel + "/", pat) for pat in excludes):
        return
    raise ToolError(f"cannot list {rel}/: {error}; its files would be missing from the digest: "
                    f"fix its permissions or pass --exclude '{rel}/*'")


def _select(found: Iterable[tuple[str, Mapping[str, Any]]], root: str, src: str, includes: Sequence[str],
            excludes: Sequence[str], quoted: bool, bar: Any) -> tuple[list[SourceFile], bool]:
    """(the files of the listing `found` that are selected, whether it listed any file),
    each entry counted on `bar`."""
    prefix = root.rstrip("/") + "/"
    files = []
    listed = False
    for path, info in found:
        kind = info.get("type", "file")
        if kind == "directory":
            continue
        bar.update(1)
        if kind == "unlisted":
            _check_unlisted(path, prefix, info["error"], excludes, src)
            continue
        listed = True
        if not path.startswith(prefix):
            raise ToolError(f"listing of {src} returned {path!r}, which is outside it")
        rel = _url_name(path[len(prefix):], src) if quoted else path[len(prefix):]
        if includes and not any(fnmatch.fnmatchcase(rel, pat) for pat in includes):
            continue
        if any(fnmatch.fnmatchcase(rel, pat) for pat in excludes):
            continue
        _check_utf8(rel)
        _check_entry(rel)
        if kind != "file":
            what = _not_a_file(path, info)
            if what:
                raise ToolError(f"cannot read {rel}: {what}; remove it or pass --exclude")
        files.append(SourceFile(path, rel, info.get("size")))
    return files, listed


def list_source(
    fs: Any, base: str, src: str, includes: Sequence[str], excludes: Sequence[str] = (), quiet: bool = True
) -> tuple[str, list[SourceFile]]:
    """Root path and the sorted data files under it (SRC may be a single file), counted
    on a progress bar unless quiet.

    Entries that are neither files nor directories (broken symlinks, FIFOs)
    are errors rather than silently missing data, unless excluded."""
    with progress(None, quiet, "listing", unit=" files") as bar:
        root, found = _listing(fs, base, src, bar)
        files, listed = _select(found, root, src, includes, excludes, url_quoted(fs), bar)
    if not listed:
        try:
            exists = fs.exists(base)
        except Exception:  # treat an unreachable source as missing
            exists = False
        raise ToolError(f"empty dataset: no files under {src}" if exists else f"source not found: {src}")
    if not files:
        chosen = " ".join([*(f"--include {p}" for p in includes), *(f"--exclude {p}" for p in excludes)])
        raise ToolError(f"empty dataset: no file under {src} is selected by {chosen}")
    # Code-point order == UTF-8 byte order: the same on every machine.
    files.sort(key=lambda f: f.rel)
    return root, files
