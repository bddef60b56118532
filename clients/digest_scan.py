"""Hashing for ``tools/digest``: the listed files' items, by a pool of threads (whole
local files) or processes (record formats parse in Python), in file order, with a
progress bar moved by the bytes the workers read."""

from __future__ import annotations

import concurrent.futures as cf
import concurrent.futures.process  # noqa: F401  (eager: keep imports out of timings)
import functools
import hashlib
import multiprocessing
from collections.abc import Iterator
from typing import Any

from clients.digest_source import SourceFile, ToolError, is_local
from clients.digest_work import Job, ThreadCounter, progress, submit_bounded
from clients.itemscan import (
    FileItems,
    Report,
    ScanError,
    add_to,
    files_in_progress,
    report_to,
    scan_local_batch,
    scan_remote,
)

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
                                            verify_crc, report, batch.start)
    else:
        for i, f in enumerate(files):
            yield range(i, i + 1), scan_remote, (fs, kind, f.path, f.rel, f.size, verify_crc, report)


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
    local = is_local(fs)
    if local and workers == 1:
        return _scan_alone(files, kind, verify_crc, total, quiet)
    results: Scanned = []
    read: Any = ThreadCounter()  # bytes read by all workers
    report: Report | None = functools.partial(add_to, read)
    doing = None  # the file each worker process is on
    ex: cf.Executor
    if local and kind != "files":
        # Record formats parse framing in Python, which holds the GIL. A job cannot carry
        # the counter to a process: each inherits it.
        read = multiprocessing.Value("Q", 0)
        doing = multiprocessing.Array("q", 2 * workers)
        ex = cf.ProcessPoolExecutor(workers, initializer=report_to, initargs=(read, doing))
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
        raise ToolError(_died(files, doing)) from None
    finally:
        ex.shutdown(wait=True, cancel_futures=True)
    results.sort(key=lambda r: r[0].start)  # jobs are runs of consecutive files
    return results


def _died(files: list[SourceFile], doing: Any) -> str:
    """The error of a worker process that died, naming the files the workers were on (its
    among them: it may be one too large for memory, or with records too large)."""
    on = [files[i].rel for i in sorted(files_in_progress(doing))] if doing is not None else []
    where = ""
    if len(on) == 1:
        where = f" while hashing {on[0]}"
    elif on:
        shown = ", ".join(on[:8]) + (f" and {len(on) - 8} more" if len(on) > 8 else "")
        where = f" while the workers were hashing {shown} (one of these)"
    return f"a hashing worker process died{where} (killed, or out of memory?)"


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
