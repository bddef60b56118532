"""`tools/digest verify`: read a digest's items back from the store and compare sizes,
SHA-256 and, in a format-3 digest, BLAKE3 (the column clients check reads against)."""
from __future__ import annotations

import concurrent.futures as cf
import functools
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import blake3

from clients.digest import Digest, Kind
from clients.digest_paths import store_path, url_quoted
from clients.digest_work import ThreadCounter, progress, submit_bounded
from clients.itemscan import REMOTE_BLOCK, SMALL_REMOTE, Tally, add_to, hash_stream

Hashed = tuple[bytes | None, int, bytes | None]  # (sha256, size, blake3); sha None: not read


def _whole_file(fs: Any, full: str, size: int, stream: Callable[[Any], Hashed], want_b3: bool,
                tally: Tally) -> Hashed:
    """Hashes of the file ``full``, an item of ``size`` bytes of a 'files' digest, or (None,
    its size) when that differs: told by its size first, not by reading a file that grew
    (to gigabytes, perhaps) whole. A store that does not say a size is read whole."""
    if size > SMALL_REMOTE:
        with fs.open(full, "rb", block_size=REMOTE_BLOCK) as f:
            n = getattr(f, "size", None)
            return stream(f) if n is None or n == size else (None, n, None)
    if size:  # one byte more than the item: more back means the file grew
        data = fs.cat_file(full, start=0, end=size + 1)
        if len(data) > size:  # an HTTP server that ignores Range sent it whole
            n = fs.size(full)
            if n is not None and n != size:
                return None, n, None
    else:  # a range from 0 of an empty object is refused: ask its size
        n = fs.size(full)
        if n:
            return None, n, None
        data = b"" if n == 0 else fs.cat_file(full)  # None: the store does not say
    tally.add(len(data))
    return hashlib.sha256(data).digest(), len(data), blake3.blake3(data).digest() if want_b3 else None


def _range_ignored(i: int, rel: str, off: int, size: int, got: int) -> str:
    return (f"item {i}: {rel} @ {off}+{size}: the store ignores range requests (asked for bytes "
            f"{off}-{off + size - 1}, got {got} bytes: the whole file?); serve the "
            "data from a store that honours HTTP Range (python -m http.server does not)")


def _check_path(fs: Any, base: str, digest: Digest, j: int, items: list[int],
                report: Any = None) -> list[tuple[int, str]]:
    """``(item, problem)`` pairs from re-reading items all stored in path ``j``."""
    rel = digest.path(j)
    full = store_path(base, rel, url_quoted(fs, digest))
    problems: list[tuple[int, str]] = []
    col = digest.blake3  # format 3: clients check reads against it, so verify checks it too
    tally = Tally(report)

    def stream(f: Any, limit: int | None = None) -> Hashed:
        b3 = None if col is None else blake3.blake3()
        sha, n = hash_stream(f, limit, also=b3, tally=tally)
        return sha, n, None if b3 is None else b3.digest()

    def compare(i: int, sha: bytes | None, n: int, b3: bytes | None) -> None:
        _, off, size = digest.location(i)
        if n != size:
            problems.append((i, f"item {i}: {rel} @ {off}+{size}: size mismatch (store has {n} bytes)"))
        elif sha != digest.sha256(i):
            problems.append((i, f"item {i}: {rel} @ {off}+{size}: sha256 mismatch"))
        elif col is not None and b3 != col[i].tobytes():
            problems.append((i, f"item {i}: {rel} @ {off}+{size}: blake3 mismatch (the digest's BLAKE3 "
                                "column disagrees with the data and its SHA-256)"))

    try:
        if digest.kind is Kind.FILES:
            for i in items:
                compare(i, *_whole_file(fs, full, digest.size(i), stream, col is not None, tally))
        elif len(items) <= 4:  # a few records: a range each
            for i in items:
                _, off, size = digest.location(i)
                data = fs.cat_file(full, start=off, end=off + size) if size else b""
                tally.add(len(data))
                if len(data) > size:  # not a size mismatch of the item: the store's fault
                    problems.append((i, _range_ignored(i, rel, off, size, len(data))))
                    continue
                compare(i, hashlib.sha256(data).digest(), len(data),
                        None if col is None else blake3.blake3(data).digest())
        else:  # many records of one file: one sequential pass
            with fs.open(full, "rb", block_size=REMOTE_BLOCK) as f:
                for i in sorted(items, key=lambda i: int(digest.offsets[i])):
                    _, off, size = digest.location(i)
                    f.seek(off)
                    compare(i, *stream(f, size))
    except Exception as e:  # any backend error: report, keep verifying others
        shown = ", ".join(map(str, items[:5])) + (", ..." if len(items) > 5 else "")
        problems.append((items[0], f"item(s) {shown} ({rel}): cannot read: {type(e).__name__}: {e}"))
    # The bar's total is the items' sizes: what was not read (a mismatch, an error) counts too.
    tally.file_done(sum(digest.size(i) for i in items))
    tally.flush()
    return problems


def verify_digest(
    digest: Digest, fs: Any, base: str, indices: Sequence[int], workers: int, quiet: bool
) -> list[str]:
    groups: dict[int, list[int]] = {}
    for i in indices:
        groups.setdefault(int(digest.path_index[i]), []).append(i)
    problems: list[tuple[int, str]] = []
    read = ThreadCounter()  # bytes read by all threads: the bar moves within large files too
    report = functools.partial(add_to, read)
    # Threads even for local files: hashlib and file reads release the GIL.
    with cf.ThreadPoolExecutor(workers, thread_name_prefix="verify") as ex, \
            progress(sum(int(digest.sizes[i]) for i in indices), quiet, "verifying") as bar:
        jobs = ((items, _check_path, (fs, base, digest, j, items, report)) for j, items in groups.items())
        for items, fut in submit_bounded(ex, jobs, 4 * workers, tick=lambda: bar.update(read.value - bar.n)):
            problems.extend(fut.result())
        bar.update(read.value - bar.n)
    return [msg for _, msg in sorted(problems)]
