"""Reading items from the store a digest names, checked against it.

The store is the slow, shared source of truth behind the cache: every read
here is checked against the digest (size, and BLAKE3 where the digest carries
it, else SHA-256) when asked to, and the cache is filled from what passes.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any

from .digest import Digest, ItemMismatch, Kind
from .digest_paths import store_path, url_quoted


class ReadBrokenOff(OSError):
    """A store read cancelled under its caller: the process exits (ProcessState.break_reads)."""


def _not_broken(data: Any, what: str) -> Any:
    """data from an async fsspec call: None where the call's task was cancelled (fsspec's
    sync() then returns None rather than raising)."""
    if data is None:
        raise ReadBrokenOff(f"the store read of {what} was broken off: the process is exiting")
    return data


def _item_range(digest: Digest, i: int, base: str, quoted: bool = False) -> tuple[str, int | None, int | None]:
    """(full path, start, end) of item i's read (quoted: into a URL, url_quoted): whole
    files are read whole, so a grown file is noticed by the size check."""
    path, offset, length = digest.location(i)
    full = store_path(base, path, quoted)
    if digest.kind is Kind.FILES:
        return full, None, None
    return full, offset, offset + length


def item_matches(digest: Digest, i: int, data: bytes, by_key: bool = False) -> bool:
    """Whether data is item i: by its BLAKE3 where the digest carries it (version 3;
    several times faster), else by its SHA-256. The digest is the user's own trusted
    record, so either hash ties the data to the SHA-256 that is its key. With by_key,
    by the SHA-256 itself: for items bound for a plain cache dir, which other digests
    read unhashed (docs/security.md), so one digest's columns must not vouch for it."""
    b3 = digest.blake3
    if b3 is not None and not by_key:
        import blake3  # lazy: loading digests must not need it

        return blake3.blake3(data).digest() == b3[digest.index(i)].tobytes()
    return hashlib.sha256(data).digest() == digest.sha256(i)


def _check_item(digest: Digest, i: int, data: bytes, verify: bool, by_key: bool = False) -> bytes:
    length = int(digest.size(i))
    if verify and (len(data) != length or not item_matches(digest, i, data, by_key)):
        path, offset, _ = digest.location(i)
        if digest.kind is not Kind.FILES and len(data) > length:
            raise ItemMismatch(f"item {i} ({path} @ {offset}+{length}): the store returned {len(data)} "
                               f"bytes for a {length}-byte range; does it ignore range requests?")
        if by_key and len(data) == length and digest.blake3 is not None and item_matches(digest, i, data):
            raise ItemMismatch(f"item {i} ({path} @ {offset}+{length}) matches the digest's BLAKE3 but not "
                               f"its SHA-256: the digest is inconsistent (check it with tools/digest verify)")
        raise ItemMismatch(f"item {i} ({path} @ {offset}+{length}) does not match the digest")
    return data


def read_item(
    digest: Digest, i: int, fs: Any = None, *, verify: bool = False, by_key: bool = False,
    **storage_options: Any
) -> bytes:
    """Read item ``i`` from the store under ``digest.root`` through fsspec.

    ``fs`` is an fsspec filesystem for the root's protocol; when omitted it
    comes from ``fsspec.core.url_to_fs(root, **storage_options)``.  Records use
    one range read.  With ``verify``, a content mismatch raises ItemMismatch
    (``by_key``: checked by the SHA-256, item_matches).
    """
    import fsspec  # lazy: loading digests must not need the storage stack

    if fs is None:
        fs, _ = fsspec.core.url_to_fs(digest.root, **storage_options)
    # Not url_to_fs's path: it reads a root with '::' ('file:///data/x::y') as a chain.
    base = fs._strip_protocol(digest.root)
    full, start, end = _item_range(digest, i, base, url_quoted(fs, digest))
    if start is not None and start == end:
        data = b""
    elif type(fs) is _local_fs():  # exactly it: a subclass may read differently
        data = cat_local(full, start, end)
    else:
        data = _not_broken(fs.cat_file(full, start=start, end=end), full)
    return _check_item(digest, i, data, verify, by_key)


@functools.cache
def _local_fs() -> type:
    from fsspec.implementations.local import LocalFileSystem

    return LocalFileSystem


def cat_local(path: str, start: int | None = None, end: int | None = None) -> bytes:
    """What LocalFileSystem.cat_file returns (bytes [start, end) of a local file, fewer
    at its end; the whole file without a range) without fsspec's file object: that
    costs about 5 us a read, a third of a 110 KB read's CPU (docs/benchmarks.md)."""
    with open(path, "rb", buffering=0) as f:
        if start is None and end is None:
            return f.readall()
        start = start or 0
        if start < 0 or (end is not None and end < start):
            raise ValueError(f"{path}: a range read needs 0 <= start <= end, got {start}, {end}")
        f.seek(start)
        if end is None:
            return f.readall()
        parts, want = [], end - start
        while want > 0:  # one read() per call may return less than asked (over 2 GiB on Linux)
            chunk = f.read(want)
            if not chunk:
                break
            parts.append(chunk)
            want -= len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)


def read_items(digest: Digest, indices: Sequence[int], fs: Any, *, verify: bool = False,
               concurrency: int = 16, pool: Executor | None = None, by_key: bool = False) -> list[bytes]:
    """Read several items, at most ``concurrency`` at a time; the first failure raises.

    An async filesystem (http, gcs, s3) reads the whole batch in one call on its
    event loop (``cat_ranges``): per item that costs about half the client CPU
    of one blocking ``cat_file`` per thread (tools/bench/misspath). Others
    (local) read in ``pool`` when given, else one after another: in at most
    ``concurrency`` shares of consecutive items, each share one task (a task per
    item cost a thread hand-off per item, about as much CPU as the read)."""
    indices = list(indices)
    if len(indices) <= 1 or not getattr(fs, "async_impl", False):
        if len(indices) > 1 and pool is not None:
            n = min(len(indices), max(1, concurrency))
            shares = [indices[len(indices) * k // n:len(indices) * (k + 1) // n] for k in range(n)]
            return [data for part in pool.map(lambda share: [read_item(digest, i, fs, verify=verify, by_key=by_key)
                                                              for i in share], shares) for data in part]
        return [read_item(digest, i, fs, verify=verify, by_key=by_key) for i in indices]
    base = fs._strip_protocol(digest.root)
    quoted = url_quoted(fs, digest)
    ranges = [_item_range(digest, i, base, quoted) for i in indices]
    want = [p for p, (_, s, e) in enumerate(ranges) if s is None or s != e]
    got = fs.cat_ranges([ranges[p][0] for p in want], [ranges[p][1] for p in want],
                        [ranges[p][2] for p in want], batch_size=max(1, concurrency), on_error="return")
    got = _not_broken(got, f"{len(want)} items") if want else got
    out: list[bytes] = [b""] * len(indices)
    for p, data in zip(want, got):
        if isinstance(data, asyncio.CancelledError):
            raise ReadBrokenOff(f"the store read of {ranges[p][0]} was broken off: the process is exiting")
        if isinstance(data, BaseException):
            raise data
        out[p] = data
    return [_check_item(digest, i, data, verify, by_key) for i, data in zip(indices, out)]
