"""`tools/digest verify`: read a digest's items back from the store and compare sizes,
SHA-256 and, in a format-3 digest, BLAKE3 (the column clients check reads against)."""
from __future__ import annotations

import concurrent.futures as cf
import hashlib
from collections.abc import Sequence
from typing import Any

import blake3

from clients.digest import Digest, Kind
from clients.digest_paths import store_path, url_quoted
from clients.digest_work import progress, submit_bounded
from clients.itemscan import REMOTE_BLOCK, SMALL_REMOTE, hash_stream


def _check_path(fs: Any, base: str, digest: Digest, j: int, items: list[int]) -> list[tuple[int, str]]:
    """``(item, problem)`` pairs from re-reading items all stored in path ``j``."""
    rel = digest.path(j)
    full = store_path(base, rel, url_quoted(fs, digest))
    problems: list[tuple[int, str]] = []
    col = digest.blake3  # format 3: clients check reads against it, so verify checks it too

    def stream(f: Any, limit: int | None = None) -> tuple[bytes, int, bytes | None]:
        b3 = None if col is None else blake3.blake3()
        sha, n = hash_stream(f, limit, also=b3)
        return sha, n, None if b3 is None else b3.digest()

    def compare(i: int, sha: bytes, n: int, b3: bytes | None) -> None:
        _, off, size = digest.location(i)
        if n != size:
            problems.append((i, f"item {i}: {rel} @ {off}+{size}: size mismatch (store has {n} bytes)"))
        elif sha != digest.sha256(i):
            problems.append((i, f"item {i}: {rel} @ {off}+{size}: sha256 mismatch"))
        elif col is not None and b3 != col[i].tobytes():
            problems.append((i, f"item {i}: {rel} @ {off}+{size}: blake3 mismatch (the digest's BLAKE3 "
                                "column disagrees with the data and its SHA-256)"))

    try:
        if digest.kind is Kind.FILES or len(items) <= 4:
            for i in items:
                _, off, size = digest.location(i)
                if digest.kind is Kind.FILES and size > SMALL_REMOTE:
                    with fs.open(full, "rb", block_size=REMOTE_BLOCK) as f:
                        sha, n, b3 = stream(f)
                else:
                    # Whole file for 'files' (so growth shows); a range otherwise.
                    data = fs.cat_file(full) if digest.kind is Kind.FILES else (
                        fs.cat_file(full, start=off, end=off + size) if size else b"")
                    sha, n = hashlib.sha256(data).digest(), len(data)
                    b3 = None if col is None else blake3.blake3(data).digest()
                compare(i, sha, n, b3)
        else:  # many records of one file: one sequential pass
            with fs.open(full, "rb", block_size=REMOTE_BLOCK) as f:
                for i in sorted(items, key=lambda i: int(digest.offsets[i])):
                    _, off, size = digest.location(i)
                    f.seek(off)
                    compare(i, *stream(f, size))
    except Exception as e:  # any backend error: report, keep verifying others
        shown = ", ".join(map(str, items[:5])) + (", ..." if len(items) > 5 else "")
        problems.append((items[0], f"item(s) {shown} ({rel}): cannot read: {type(e).__name__}: {e}"))
    return problems


def verify_digest(
    digest: Digest, fs: Any, base: str, indices: Sequence[int], workers: int, quiet: bool
) -> list[str]:
    groups: dict[int, list[int]] = {}
    for i in indices:
        groups.setdefault(int(digest.path_index[i]), []).append(i)
    problems: list[tuple[int, str]] = []
    # Threads even for local files: hashlib and file reads release the GIL.
    with cf.ThreadPoolExecutor(workers, thread_name_prefix="verify") as ex, \
            progress(sum(int(digest.sizes[i]) for i in indices), quiet, "verifying") as bar:
        jobs = ((items, _check_path, (fs, base, digest, j, items)) for j, items in groups.items())
        for items, fut in submit_bounded(ex, jobs, 4 * workers):
            problems.extend(fut.result())
            bar.update(sum(int(digest.sizes[i]) for i in items))
    return [msg for _, msg in sorted(problems)]
