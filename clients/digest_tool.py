"""Implementation of ``tools/digest``: create, inspect and verify digest files.

Exit codes: 0 success, 1 failure (unreadable or bad data, missing source,
verification mismatch), 2 usage error (bad command line).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import concurrent.futures.process  # noqa: F401  (eager: keep imports out of timings)
import datetime
import difflib
import fnmatch
import functools
import hashlib
import json
import multiprocessing
import os
import random
import re
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import unquote

import numpy as np

from cacheserver.sizes import format_size
from clients import crc32c, targets
from clients.digest import Digest, DigestBuilder, DigestError, Kind
from clients.digest_paths import url_quoted
from clients.digest_verify import verify_digest
from clients.digest_work import Job, progress, submit_bounded
from clients.itemscan import (FileItems, Report, ScanError, add_to, report_to, scan_local_batch,
                              scan_remote)

TOOL = "mlcache tools/digest 1"
EXIT_FAIL = 1
EXIT_USAGE = 2
MAX_REPORTED = 50  # problems printed by verify before summarising


class ToolError(Exception):
    """A runtime failure, reported as 'digest: error: ...' with exit code 1."""


class SourceFile(NamedTuple):
    path: str  # as the filesystem names it
    rel: str  # relative to the root, '/'-separated
    size: int | None  # from the listing; None when the backend does not say


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _is_local(fs: Any) -> bool:
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
    except OSError:
        return "a broken symlink"
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
    fs.find(base, detail=True) gives them (unreadable directories skipped, as there),
    without find's info dict per file held to the end: about 600 bytes a file, most of
    the tool's memory on millions of small files."""
    todo = [base]
    while todo:
        try:
            it = os.scandir(todo.pop())
        except OSError:
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


def _listing(fs: Any, base: str, src: str) -> tuple[str, Iterable[tuple[str, Mapping[str, Any]]]]:
    """(root, (path, info) of each entry under it): SRC's files, or SRC and its directory."""
    if _is_local(fs) and os.path.isdir(base):
        return base, _local_listing(base)
    try:
        found = fs.find(base, detail=True)
    except FileNotFoundError:
        raise ToolError(f"source not found: {src}") from None
    except Exception as e:  # network / permission errors of any backend
        raise ToolError(f"cannot list {src}: {type(e).__name__}: {e}") from None
    if list(found) == [base]:  # SRC is one file: its directory is the root
        return fs._parent(base), found.items()
    return base, found.items()


def list_source(
    fs: Any, base: str, src: str, includes: Sequence[str], excludes: Sequence[str] = ()
) -> tuple[str, list[SourceFile]]:
    """Root path and the sorted data files under it (SRC may be a single file).

    Entries that are neither files nor directories (broken symlinks, FIFOs)
    are errors rather than silently missing data, unless excluded."""
    root, found = _listing(fs, base, src)
    prefix = root.rstrip("/") + "/"
    quoted = url_quoted(fs)
    files = []
    listed = False
    for path, info in found:
        kind = info.get("type", "file")
        if kind == "directory":
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
        if kind != "file":
            what = _not_a_file(path, info)
            if what:
                raise ToolError(f"cannot read {rel}: {what}; remove it or pass --exclude")
        files.append(SourceFile(path, rel, info.get("size")))
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


# -- hashing -------------------------------------------------------------------


def _batches(files: list[SourceFile], workers: int) -> list[range]:
    # Several batches per worker balance uneven files; batching many small
    # files amortises the inter-process round trip.
    total = sum(f.size or 0 for f in files)
    target = min(max(total // (workers * 16), 1 << 20), 64 << 20)
    out: list[range] = []
    start = cur_bytes = 0
    for i, f in enumerate(files):
        cur_bytes += f.size or 0
        if cur_bytes >= target or i + 1 - start >= 1024:
            out.append(range(start, i + 1))
            start, cur_bytes = i + 1, 0
    if start < len(files):
        out.append(range(start, len(files)))
    return out


def _scan_jobs(fs: Any, files: list[SourceFile], kind: str, workers: int, verify_crc: bool,
               local: bool, report: Report | None) -> Iterator[Job]:
    """(file indices, function, arguments) of each unit of hashing work, made as needed;
    thread jobs tell `report` their progress (process jobs the counter of report_to)."""
    if local:
        for batch in _batches(files, workers):
            yield batch, scan_local_batch, (kind, [(files[i].path, files[i].rel) for i in batch],
                                            verify_crc, report)
    else:
        for i, f in enumerate(files):
            yield range(i, i + 1), scan_remote, (fs, kind, f.path, f.rel, f.size, verify_crc, report)


class _ThreadCounter:
    """itemscan.add_to's counter for threads: a multiprocessing.Value without the shared memory
    and semaphore (which some sandboxes lack)."""

    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def get_lock(self) -> threading.Lock:
        return self._lock


Scanned = list[tuple[range, FileItems]]  # (indices of consecutive files, their items), in order


def _scan_alone(files: list[SourceFile], kind: str, verify_crc: bool, total: int | None,
                quiet: bool) -> Scanned:
    """scan_files of local files in this thread (one worker)."""
    results = []
    with progress(total, quiet, "hashing") as bar:
        for batch in _batches(files, 1):
            try:
                items = scan_local_batch(kind, [(files[i].path, files[i].rel) for i in batch], verify_crc,
                                         bar.update)
            except ScanError as e:  # as from the pools: a message, not a traceback
                raise ToolError(str(e)) from None
            results.append((batch, items))
    return results


def scan_files(
    fs: Any, files: list[SourceFile], kind: str, workers: int, verify_crc: bool, quiet: bool
) -> Scanned:
    """Items of every file, in file order whatever the scheduling. The bar moves by the
    bytes the workers read, told through a shared counter: within large files too."""
    total = None if any(f.size is None for f in files) else sum(f.size for f in files)  # type: ignore[misc]
    local = _is_local(fs)
    if local and workers == 1:
        return _scan_alone(files, kind, verify_crc, total, quiet)
    results: Scanned = []
    read: Any = _ThreadCounter()  # bytes read by all workers
    report: Report | None = functools.partial(add_to, read)
    ex: cf.Executor
    if local and kind != "files":
        # Record formats parse framing in Python, which holds the GIL. A job cannot carry
        # the counter to a process: each inherits it.
        read = multiprocessing.Value("Q", 0)
        ex = cf.ProcessPoolExecutor(workers, initializer=report_to, initargs=(read,))
        report = None
    else:
        # Whole local files: reads and hashlib both release the GIL, so threads scale
        # like processes without forking (a fixed ~10 ms per worker) or pickling
        # results. Remote reads wait on the network.
        ex = cf.ThreadPoolExecutor(workers, thread_name_prefix="digest")
    try:
        # The first jobs fork the pool's processes: before the bar starts its thread.
        done = submit_bounded(ex, _scan_jobs(fs, files, kind, workers, verify_crc, local, report),
                              4 * workers, tick=lambda: bar.update(read.value - bar.n))
        with progress(total, quiet, "hashing") as bar:
            for batch, fut in done:
                results.append((batch, fut.result()))
            bar.update(read.value - bar.n)
    except ScanError as e:
        raise ToolError(str(e)) from None
    except cf.process.BrokenProcessPool:
        raise ToolError("a hashing worker process died (killed, or out of memory?)") from None
    finally:
        ex.shutdown(wait=True, cancel_futures=True)
    results.sort(key=lambda r: r[0].start)  # jobs are runs of consecutive files
    return results


def _range_probe(fs: Any, root: str, f: SourceFile, off: int, size: int, sha: bytes | None) -> None:
    """Read `size` bytes at `off` of f by range; a store that answers with something else
    (an HTTP server ignoring Range sends the whole file) is refused, naming the fix."""
    try:
        data = fs.cat_file(f.path, start=off, end=off + size)
    except Exception as e:  # any backend: say it, as the scan would
        raise ToolError(f"cannot range-read {f.rel}: {type(e).__name__}: {e}") from None
    if len(data) > size or (sha is not None and (len(data) != size or hashlib.sha256(data).digest() != sha)):
        raise ToolError(
            f"the store at {fs.unstrip_protocol(root)} ignores range requests: asked for "
            f"bytes {off}-{off + size - 1} of {f.rel}, got {len(data)} bytes. Records and "
            "tar members are read back by range, so this digest could not be read; "
            "serve the data from a store that honours HTTP Range (python -m http.server "
            "does not; tools/objstore.py, GCS, S3 do) or use --format files")


def probe_range_support(fs: Any, root: str, files: list[SourceFile]) -> None:
    """Before the scan: the first byte of a file that may hold more (more bytes back: Range
    ignored), so such a store fails in seconds rather than after hashing the whole dataset."""
    f = next((f for f in files if f.size is None or f.size >= 2), None)
    if f is not None:
        _range_probe(fs, root, f, 0, 1, None)


def check_range_support(fs: Any, root: str, files: list[SourceFile], scanned: Scanned) -> None:
    """Records are read back by range: a store that answers a range request with the
    whole file would fail every read later with a misleading mismatch. Read one item
    that is not its whole file, and check its hash."""
    for batch, items in scanned:
        for k, i in enumerate(batch):
            f = files[i]
            for j in items.file(k):
                off, size, sha, *_ = items[j]
                if size and (off or f.size is None or size != f.size):
                    _range_probe(fs, root, f, off, size, sha)
                    return


# -- command line ----------------------------------------------------------------


def _storage_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:  # JSON values allow anon=true, block_size=1024, client_kwargs={...}
        return key, json.loads(value)
    except ValueError:
        return key, value


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def _add_storage_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage-option", "-s", metavar="KEY=VALUE", action="append", default=[],
                   type=_storage_option,
                   help="fsspec storage option (repeatable); VALUE is parsed as JSON when it can be, "
                        "e.g. token=anon, anon=true, endpoint_url=http://...")


def _create_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        usage=f"{prog} [create] SRC -o FILE [options]\n"
              f"       {prog} info FILE [--json]\n"
              f"       {prog} verify FILE [--sample N] [options]",
        description="Hash every item of a dataset into a digest file "
                    f"('{prog} info -h' and '{prog} verify -h' for the other commands).",
        epilog="SRC is a local directory or an fsspec URL (gs://, s3://, http(s)://, memory://). "
               "Exit codes: 0 ok, 1 failure, 2 usage error.")
    p.add_argument("src", metavar="SRC", help="dataset directory, prefix or single file")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="digest file to write")
    p.add_argument("--format", "-f", choices=[k.value for k in Kind], default="files",
                   help="files: one item per file; tfrecord: one per record; tar: one per member "
                        "(default: files)")
    p.add_argument("--workers", "-j", type=_positive, default=None, metavar="N",
                   help="parallel hashers (default: cores for local SRC, 4 x cores and at least "
                        "8 for remote URLs): threads, except processes for local tfrecord/tar, "
                        "whose record framing is parsed in Python under the GIL")
    p.add_argument("--include", metavar="GLOB", action="append", default=[],
                   help="only files whose relative path matches (repeatable; default for tar: *.tar)")
    p.add_argument("--exclude", metavar="GLOB", action="append", default=[],
                   help="skip files whose relative path matches (repeatable)")
    p.add_argument("--no-crc", action="store_true", help="skip TFRecord data CRC checks")
    p.add_argument("--targets", metavar="dir|FILE", default=None,
                   help="record a target (label) per item: 'dir' = the item's top-level directory "
                        "is its class (torchvision ImageFolder: classes sorted by name); FILE = a JSON "
                        "object {relpath: label} or a CSV of path,label rows")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    _add_storage_options(p)
    return p


def _info_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"{prog} info", description="Print a digest file's header and totals.")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def _verify_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"{prog} verify",
        description="Re-read items from the store and compare their SHA-256 with the digest.",
        epilog="Exit codes: 0 all match, 1 mismatches or errors (each named), 2 usage error.")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--sample", type=_positive, metavar="N", help="check N random items instead of all")
    p.add_argument("--seed", type=int, help="random seed for --sample")
    p.add_argument("--workers", "-j", type=_positive, default=None, metavar="N",
                   help="parallel readers (threads)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    _add_storage_options(p)
    return p


def _load_labels(spec: str | None) -> dict[str, str | int] | None:
    """The labels file of --targets FILE, read before the scan."""
    if spec is None or spec == targets.DIR:
        return None
    try:
        return targets.load_labels(spec)
    except targets.TargetError as e:
        raise ToolError(str(e)) from None


def _targets_for(spec: str | None, labels: dict[str, str | int] | None,
                 paths: list[str]) -> tuple[list[int] | None, list[str]]:
    """(targets, classes) of --targets for these paths (files, then items); (None, [])
    without it. Every item of a file shares the file's label, so the listed files alone
    show any path --targets cannot label."""
    if spec is None:
        return None, []
    try:
        return targets.derive(spec, paths, labels)
    except targets.TargetError as e:
        raise ToolError(str(e)) from None


def _worker_kind(local: bool, kind: Kind, workers: int) -> str:
    if workers == 1:
        return "process"
    return "processes" if local and kind is not Kind.FILES else "threads"


def _check_output(out: Path, parser: argparse.ArgumentParser) -> None:
    """Refuse an output the digest could not be saved to before hashing, not after."""
    if out.is_dir():
        parser.error(f"output {str(out)!r} is a directory; -o takes the digest file to write")
    if not out.parent.is_dir():
        parser.error(f"output directory {str(out.parent)!r} does not exist")
    try:  # as Digest.save will: a temp file beside the output
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise ToolError(f"cannot write {out}: {e.strerror or e}") from None


def _without_output(files: list[SourceFile], out: Path) -> list[SourceFile]:
    """files less the digest being written and Digest.save's temp files, when SRC holds
    them: a second run would digest the first one's output, which it then replaces."""
    where = os.path.realpath(out.parent)
    temp = f".{out.name}.*.tmp"

    def ours(f: SourceFile) -> bool:
        name = os.path.basename(f.path)
        return ((name == out.name or fnmatch.fnmatchcase(name, temp))
                and os.path.realpath(os.path.dirname(f.path)) == where)
    return [f for f in files if not ours(f)]


def _save(digest: Digest, out: Path) -> None:
    try:
        digest.save(out)
    except OSError as e:  # e.g. a full disk: name the output, not save's temp file
        raise ToolError(f"cannot write {out}: {e.strerror or e}") from None


def _add_scanned(builder: DigestBuilder, files: list[SourceFile], scanned: Scanned) -> None:
    """Add the scanned items to builder in file order, dropping each job's items once added:
    the items are held once, not twice."""
    scanned.reverse()
    while scanned:
        batch, items = scanned.pop()
        for k, i in enumerate(batch):
            builder.add_many(files[i].rel, *items.columns(items.file(k)))
        del items  # not held on through build and save


def cmd_create(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    out = Path(args.output)
    _check_output(out, parser)
    kind = Kind(args.format)
    so = dict(args.storage_option)
    fs, base = open_source(args.src, so)
    includes = args.include or (["*.tar"] if kind is Kind.TAR else [])
    local = _is_local(fs)
    if not local and not args.quiet and sys.stderr.isatty():
        # a remote listing can take long (large buckets, or retries when unreachable)
        print(f"digest: listing {args.src} ...", file=sys.stderr, flush=True)
    root, files = list_source(fs, base, args.src, includes, args.exclude)
    if local:
        files = _without_output(files, out)
        if not files:
            raise ToolError(f"empty dataset: no file under {args.src} but the digest {out}")
    workers = args.workers or (cpu_count() if local else max(8, 4 * cpu_count()))
    workers = min(workers, len(files))
    if kind is Kind.TFRECORD and not args.no_crc and not crc32c.FAST:
        print("digest: warning: google-crc32c is not installed; checking TFRecord CRCs in pure "
              "Python is slow (pip install google-crc32c, or pass --no-crc)", file=sys.stderr)
    if not local and kind is not Kind.FILES:
        probe_range_support(fs, root, files)
    labels = _load_labels(args.targets)
    _targets_for(args.targets, labels, [f.rel for f in files])  # a wrong --targets fails before hashing
    t0 = time.perf_counter()
    scanned = scan_files(fs, files, kind.value, workers, not args.no_crc, args.quiet)
    elapsed = time.perf_counter() - t0
    if not local and kind is not Kind.FILES:
        check_range_support(fs, root, files, scanned)
    builder = DigestBuilder(fs.unstrip_protocol(root), kind, {
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "tool": TOOL})
    _add_scanned(builder, files, scanned)
    if not len(builder):
        raise ToolError(f"empty dataset: {len(files)} file(s) under {args.src} hold no {kind.value} items")
    # Targets by path (every item of a file has the file's label): no string per item.
    paths, path_index = builder.path_table()
    found, classes = _targets_for(args.targets, labels, paths)
    digest = builder.build(None if found is None else np.asarray(found, np.int64)[path_index], classes)
    del builder
    _save(digest, out)
    nbytes = digest.total_bytes
    print(f"digest: wrote {out}: {len(digest)} items in {len(files)} files, {format_size(nbytes)} "
          f"hashed in {elapsed:.3f} s ({format_size(nbytes / max(elapsed, 1e-9))}/s, "
          f"{workers} {_worker_kind(local, kind, workers)})",
          file=sys.stderr)
    return 0


def _info_dict(path: str, d: Digest) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if d.targets is not None:
        extra["targets"] = f"{len(d.classes)} classes" if d.classes else "integers"
    if d.has_names:
        extra["names"] = "yes"
    return {"file": path, "format_version": d.version, "kind": d.kind.value, "root": d.root,
            "items": len(d), "paths": d.num_paths, "total_bytes": d.total_bytes, **extra,
            "fingerprint": d.fingerprint.hex(), **{f"meta.{k}": v for k, v in sorted(d.meta.items())}}


def cmd_info(args: argparse.Namespace) -> int:
    d = Digest.load(args.file)
    info = _info_dict(args.file, d)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    info["total_bytes"] = f"{format_size(d.total_bytes)} ({d.total_bytes} bytes)"
    width = max(map(len, info))
    for k, v in info.items():
        print(f"{k + ':':<{width + 1}} {v}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    d = Digest.load(args.file)
    fs, base = open_source(d.root, dict(args.storage_option))
    n = len(d)
    indices: Sequence[int] = range(n)
    if args.sample is not None and args.sample < n:
        indices = sorted(random.Random(args.seed).sample(range(n), args.sample))
    workers = args.workers or (cpu_count() if _is_local(fs) else max(8, 4 * cpu_count()))
    problems = verify_digest(d, fs, base, indices, workers, args.quiet)
    if problems:
        for p in problems[:MAX_REPORTED]:
            print(f"verify: {p}", file=sys.stderr)
        if len(problems) > MAX_REPORTED:
            print(f"verify: ... and {len(problems) - MAX_REPORTED} more", file=sys.stderr)
        print(f"verify: FAILED: {len(problems)} problem(s) in {len(indices)} checked items of {args.file}",
              file=sys.stderr)
        return EXIT_FAIL
    print(f"verify: OK: {len(indices)} of {n} items match {d.root}")
    return 0


def _misspelled_command(word: str, commands: Collection[str]) -> str | None:
    """The command `word` looks like a typo of, if it cannot be a SRC.

    An existing path always wins, and URLs or anything with a path separator
    are always sources: `digest ./inf -o x` with no `./inf` reports "source
    not found", not a typo.
    """
    if word.startswith("-") or "://" in word or "/" in word or os.sep in word or os.path.lexists(word):
        return None
    close = difflib.get_close_matches(word, commands, n=1, cutoff=0.6)
    return close[0] if close else None


def main(argv: Sequence[str] | None = None, prog: str = "digest") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands: dict[str, Callable[[str], argparse.ArgumentParser]] = {
        "info": _info_parser, "verify": _verify_parser, "create": _create_parser}
    implied = not (argv and argv[0] in commands)
    cmd = "create" if implied else argv[0]
    if not implied:
        argv = argv[1:]
    parser = commands[cmd](prog)
    try:
        if implied and argv:  # after an explicit `create`, argv[0] is a SRC whatever its name
            typo = _misspelled_command(argv[0], commands)
            if typo:
                parser.error(f"unknown command {argv[0]!r} (did you mean {typo!r}?)")
        args = parser.parse_args(argv)
        if cmd == "info":
            return cmd_info(args)
        if cmd == "verify":
            return cmd_verify(args)
        return cmd_create(args, parser)
    except SystemExit as e:  # argparse: --help (0) or usage error (2)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    except (ToolError, DigestError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_FAIL
    except OSError as e:  # e.g. the digest file to read is missing
        print(f"{prog}: error: {e.strerror or e}: {e.filename}", file=sys.stderr)
        return EXIT_FAIL
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
