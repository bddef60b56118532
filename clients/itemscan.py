"""Find and hash the items inside one data file: the unit of work of tools/digest.

An item is ``(offset, size, sha256, name, blake3)``: the whole file for the ``files``
kind, the data of each record for ``tfrecord``, the data of each regular member
for ``tar`` (whose member name is kept, for WebDataset sample grouping; None
otherwise); blake3 is the fast check of cached values (digest format 3). A file's items
come back packed in a FileItems, and the bytes read are told as they are read (Tally),
for the progress bar.  Everything here works on any seekable binary file object, so the
same code serves local files (in worker processes) and fsspec files (in
threads).  This module stays free of heavy imports because worker processes
import it.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import tarfile
import threading
from array import array
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

import blake3

from clients.tfrecord import RecordError, iter_records

Item = tuple[int, int, bytes, str | None, bytes]  # (offset, size, sha256, tar member name, blake3)

CHUNK = 1024 * 1024  # measured: 1 MiB reads beat 64-256 KiB (fewer syscalls)
SMALL_REMOTE = 32 * 1024 * 1024  # remote files up to this size: one GET
REMOTE_BLOCK = 8 * 1024 * 1024

KINDS = ("files", "tfrecord", "tar")
PROGRESS_STEP = 1 << 20  # bytes read between progress reports (a lock each): a few a second

Report = Callable[[int], None]  # told the bytes read since it was last told


class ScanError(Exception):
    """An item could not be read or parsed; the message names the file."""


class FileItems:
    """The items of one or more consecutive files (a job's), packed: u64 offsets and sizes,
    each hash column one bytearray, names one UTF-8 blob; ``file_ends[k]``: the items of
    files 0..k. About 80 bytes an item where a list of Item tuples per file took 300 or
    more, most of the tool's memory on millions of items. Indexes and iterates as Items."""

    __slots__ = ("offsets", "sizes", "sha256", "blake3", "names", "name_ends", "file_ends")

    def __init__(self, named: bool = False) -> None:
        self.offsets = array("Q")
        self.sizes = array("Q")
        self.sha256 = bytearray()
        self.blake3 = bytearray()
        self.names = bytearray() if named else None
        self.name_ends = array("Q") if named else None
        self.file_ends = array("Q")

    def append(self, offset: int, size: int, sha256: bytes, blake3_: bytes, name: str | None = None) -> None:
        self.offsets.append(offset)
        self.sizes.append(size)
        self.sha256 += sha256
        self.blake3 += blake3_
        if self.names is not None and self.name_ends is not None:
            self.names += (name or "").encode("utf-8")
            self.name_ends.append(len(self.names))

    def end_file(self) -> None:
        self.file_ends.append(len(self.sizes))

    def file(self, k: int) -> range:
        """The indices of the items of the job's k-th file."""
        return range(self.file_ends[k - 1] if k else 0, self.file_ends[k])

    def columns(self, r: range) -> tuple[memoryview, array[int], array[int], list[str] | None, memoryview]:
        """(sha256s, sizes, offsets, names or None, blake3s) of items r, as DigestBuilder.add_many takes them."""
        h = slice(32 * r.start, 32 * r.stop)
        names = None if self.names is None else [self.name(i) or "" for i in r]
        return (memoryview(self.sha256)[h], self.sizes[r.start:r.stop], self.offsets[r.start:r.stop], names,
                memoryview(self.blake3)[h])

    def __len__(self) -> int:
        return len(self.sizes)

    def name(self, i: int) -> str | None:
        if self.names is None or self.name_ends is None:
            return None
        return self.names[self.name_ends[i - 1] if i else 0:self.name_ends[i]].decode("utf-8")

    def __getitem__(self, i: int) -> Item:
        i = range(len(self))[i]  # negative indices; IndexError past the end
        h = slice(32 * i, 32 * i + 32)
        return self.offsets[i], self.sizes[i], bytes(self.sha256[h]), self.name(i), bytes(self.blake3[h])

    def __iter__(self) -> Iterator[Item]:
        return (self[i] for i in range(len(self)))


class Tally:
    """Bytes one job reads, told to `report` once PROGRESS_STEP of them have built up and
    when it ends: the progress bar moves within a large file for a few ns per record."""

    __slots__ = ("report", "pending", "in_file")

    def __init__(self, report: Report | None) -> None:
        self.report = report
        self.pending = 0
        self.in_file = 0

    def add(self, n: int) -> None:
        self.pending += n
        self.in_file += n
        if self.pending >= PROGRESS_STEP:
            self.flush()

    def file_done(self, size: int | None) -> None:
        """A file is scanned: its bytes not hashed (framing, tar headers) count too, so that
        what is told adds up to the listed sizes, the bar's total."""
        if size is not None and size > self.in_file:
            self.pending += size - self.in_file
        self.in_file = 0
        if self.pending >= PROGRESS_STEP:
            self.flush()

    def redo(self) -> None:
        """The file is read again: what was told of it is taken back, now (the bar moves
        back, then forward again with the new read)."""
        self.pending -= self.in_file
        self.in_file = 0
        self.flush()

    def flush(self) -> None:
        if self.pending and self.report is not None:
            self.report(self.pending)
        self.pending = 0


def add_to(counter: Any, n: int) -> None:
    """Add n to a multiprocessing.Value shared by the scanning threads or processes."""
    with counter.get_lock():
        counter.value += n


_report: Report | None = None  # where the scans of a worker process tell their progress
_doing: Any = None  # this worker's (pid, index of the file it scans, -1: none) in a shared array
_slot = -1


def report_to(counter: Any, doing: Any = None) -> None:
    """Process pool initializer: the scans of this process add the bytes they read to
    `counter` (a multiprocessing.Value, which a process inherits but a job cannot carry),
    and say in `doing` (a multiprocessing.Array of (pid, file) pairs, one per worker,
    zeros) which file they are on: a worker killed (out of memory) can then be named."""
    global _report, _doing, _slot
    _report = functools.partial(add_to, counter)
    if doing is None:
        return
    with doing.get_lock():
        free = [k for k in range(0, len(doing), 2) if doing[k] == 0]
        if free:  # else more processes than slots: this one goes unnamed
            _slot = free[0]
            doing[_slot], doing[_slot + 1] = os.getpid(), -1
            _doing = doing.get_obj()  # written by this process only: no lock per file


def files_in_progress(doing: Any) -> list[int]:
    """The indices of the files the pool's workers were scanning (see report_to)."""
    return [doing[k + 1] for k in range(0, len(doing), 2) if doing[k] and doing[k + 1] >= 0]


def _scanning(index: int) -> None:
    if _doing is not None:
        _doing[_slot + 1] = index


_local = threading.local()


def _read_buffer() -> memoryview:
    # One buffer per thread, reused: no 1 MiB allocation and zero-fill per file.
    mv = getattr(_local, "buf", None)
    if mv is None:
        mv = _local.buf = memoryview(bytearray(CHUNK))
    return mv


def hash_stream(f: BinaryIO, limit: int | None = None, also: Any = None,
                tally: Tally | None = None) -> tuple[bytes, int]:
    """SHA-256 and length of the next ``limit`` bytes of ``f`` (all if None); ``also``
    (a BLAKE3 hasher) is fed the same bytes, ``tally`` told their count."""
    h = hashlib.sha256()
    mv = _read_buffer()
    total = 0
    readinto = getattr(f, "readinto", None)
    while limit is None or total < limit:
        want = CHUNK if limit is None else min(CHUNK, limit - total)
        if readinto is not None:
            n = readinto(mv[:want])
            chunk = mv[:n] if n else b""
        else:
            chunk = f.read(want)
            n = len(chunk)
        if not n:
            break
        h.update(chunk)
        if also is not None:
            also.update(chunk)
        if tally is not None:
            tally.add(n)
        total += n
    return h.digest(), total


def scan_whole(f: BinaryIO, name: str, tally: Tally | None = None, into: FileItems | None = None) -> FileItems:
    items = FileItems() if into is None else into
    b3 = blake3.blake3()
    sha, size = hash_stream(f, also=b3, tally=tally)
    items.append(0, size, sha, b3.digest())
    return items


def scan_tfrecord(f: BinaryIO, name: str, verify_data_crc: bool = True,
                  tally: Tally | None = None, into: FileItems | None = None) -> FileItems:
    items = FileItems() if into is None else into
    # Bound methods and a local count: this loop runs once per record.
    offsets, sizes, shas, b3s = items.offsets.append, items.sizes.append, items.sha256.extend, items.blake3.extend
    read = 0  # since last told to tally
    for off, data in iter_records(f, name, verify_data_crc):
        n = len(data)
        offsets(off)
        sizes(n)
        shas(hashlib.sha256(data).digest())
        b3s(blake3.blake3(data).digest())
        read += n + 16  # with the record's 12-byte header and 4-byte footer
        if read >= PROGRESS_STEP and tally is not None:
            tally.add(read)
            read = 0
    if tally is not None:
        tally.add(read)
    return items


def _members(tf: tarfile.TarFile, name: str) -> Iterator[tarfile.TarInfo]:
    """tf's members; a header tarfile cannot parse (after the first) is a ScanError
    naming the shard, not a tarfile.ReadError escaping as a traceback."""
    it = iter(tf)
    while True:
        try:
            m = next(it)
        except StopIteration:
            return
        except tarfile.TarError as e:
            raise ScanError(f"{name}: corrupt tar archive ({e})") from None
        try:  # tarfile keeps undecodable bytes as surrogates; a digest stores UTF-8
            m.name.encode("utf-8")
        except UnicodeEncodeError:
            raw = m.name.encode("utf-8", "surrogateescape")
            raise ScanError(f"{name}: member name {raw!r} is not valid UTF-8") from None
        yield m


def scan_tar(f: BinaryIO, name: str, tally: Tally | None = None, into: FileItems | None = None) -> FileItems:
    try:
        tf = tarfile.open(fileobj=f, mode="r:")
    except tarfile.ReadError as e:
        raise ScanError(
            f"{name}: not an uncompressed tar archive ({e}); "
            "compressed shards cannot be range-read"
        ) from None
    items = FileItems(named=True) if into is None else into
    end = 0
    for m in _members(tf, name):
        end = m.offset_data + ((m.size + 511) // 512) * 512
        if not m.isreg():
            continue  # directories, links, ...: no data of their own
        if m.issparse():
            raise ScanError(f"{name}: sparse member {m.name!r} cannot be range-read")
        f.seek(m.offset_data)
        b3 = blake3.blake3()
        sha, n = hash_stream(f, m.size, also=b3, tally=tally)
        if n != m.size:
            raise ScanError(
                f"{name}: truncated member {m.name!r} at offset {m.offset_data}"
            )
        items.append(m.offset_data, m.size, sha, b3.digest(), m.name)
    # tarfile silently stops at a bad or missing header; a real archive ends
    # with a zero block, so anything else means truncation or garbage.
    f.seek(end)
    if f.read(512) != bytes(512):
        raise ScanError(
            f"{name}: no end-of-archive marker at offset {end} (truncated or corrupt tar)"
        )
    return items


def scan(kind: str, f: BinaryIO, name: str, verify_data_crc: bool = True,
         tally: Tally | None = None, into: FileItems | None = None) -> FileItems:
    """Items of one file of the given kind, appended to ``into`` if given (``tally`` told
    the bytes read as they are); raises ScanError on bad data."""
    try:
        if kind == "files":
            return scan_whole(f, name, tally, into)
        if kind == "tfrecord":
            return scan_tfrecord(f, name, verify_data_crc, tally, into)
        if kind == "tar":
            return scan_tar(f, name, tally, into)
    except RecordError as e:
        raise ScanError(str(e)) from None
    raise ValueError(f"unknown kind {kind!r}")


def scan_local_batch(
    kind: str, files: list[tuple[str, str]], verify_data_crc: bool = True, report: Report | None = None,
    first: int = 0,
) -> FileItems:
    """Worker entry: scan local ``(abspath, relpath)`` files in order, telling ``report``
    (else this process's, report_to) the bytes read as they are; ``first``: the index of
    the first file in the tool's list (told to report_to's `doing`)."""
    out = FileItems(named=kind == "tar")
    tally = Tally(report or _report)
    try:
        for k, (path, rel) in enumerate(files):
            _scanning(first + k)
            try:
                # Unbuffered for whole files (readinto straight into our buffer);
                # buffered for the many small reads of record framing.
                with open(path, "rb", buffering=0 if kind == "files" else 1 << 20) as f:
                    before = os.fstat(f.fileno())
                    scan(kind, f, rel, verify_data_crc, tally=tally, into=out)
                    after = os.fstat(f.fileno())
            except OSError as e:
                raise ScanError(f"cannot read {rel}: {e.strerror or e}") from None
            # A file still being written (a copy in progress) would leave hashes of
            # bytes that are gone by the time anyone reads them back.
            if (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns):
                raise ScanError(f"{rel} changed while it was read ({before.st_size} bytes, then "
                                f"{after.st_size}): digest it again once nothing is writing it")
            out.end_file()
            tally.file_done(after.st_size)
    finally:  # not on a file any more, whatever happened
        _scanning(-1)
    tally.flush()
    return out


# The info fields that tell one version of an object from another, where a backend
# has them: gcsfs (generation, updated), s3fs (ETag, LastModified, VersionId), HTTP
# (ETag, Last-Modified), memory (created); size everywhere.
VERSION_FIELDS = ("size", "generation", "VersionId", "ETag", "etag", "LastModified", "Last-Modified",
                  "updated", "mtime", "created")
REMOTE_ATTEMPTS = 3  # reads of an object that changed under the last one before giving up


def fresh_info(fs: Any, path: str) -> dict[str, Any]:
    """fs.info(path) asked afresh: a listing's cached entry may be older than the object."""
    fs.invalidate_cache(path)
    return fs.info(path)


def version_of(info: dict[str, Any]) -> dict[str, Any]:
    """What an object's info says identifies its current version."""
    return {k: info[k] for k in VERSION_FIELDS if info.get(k) is not None}


def _change(before: dict[str, Any], after: dict[str, Any]) -> str:
    keys = [k for k in VERSION_FIELDS if before.get(k) != after.get(k)] or ["size"]
    return ", ".join(f"{k} {before.get(k)!r} then {after.get(k)!r}" for k in keys)


def _scan_version(fs: Any, kind: str, path: str, rel: str, verify_data_crc: bool,
                  tally: Tally) -> FileItems:
    """Scan an object read by several range requests, checking that it is one version
    throughout: one replaced meanwhile would leave hashes of a mix of old and new bytes
    (or of a size the object never had). Read again while it changes, then refused."""
    why = ""
    for _ in range(REMOTE_ATTEMPTS):
        info = fresh_info(fs, path)
        before = version_of(info)
        size = before.get("size")
        # This version's size, not one open might take from a cache (reads stop there);
        # not where an HTTP server refuses ranges (open then streams the object).
        opts = {"size": size} if size and info.get("partial", True) else {}
        items = bad = None
        try:
            with fs.open(path, "rb", block_size=REMOTE_BLOCK, **opts) as f:
                items = scan(kind, f, rel, verify_data_crc, tally=tally)
        except Exception as e:  # bad framing of a mix of versions; a backend's own check (s3fs:
            bad = e             # FileExpired), a range past a new end: any, when the object changed
        after = version_of(fresh_info(fs, path))
        if bad is not None and after == before:
            raise bad  # the object's own
        whole = items is not None and kind == "files" and len(items) == 1 and size is not None
        read = items.sizes[0] if whole else size
        if items is not None and before == after and read == size:
            return items
        why = _change(before, after) if before != after else f"{read} of its {size} bytes read"
        tally.redo()  # the bar counts the bytes of the version kept, once
    raise ScanError(f"{rel} changed while it was read ({why}), {REMOTE_ATTEMPTS} "
                    "times in a row: digest it again once nothing is writing it")


def scan_remote(
    fs: Any,
    kind: str,
    path: str,
    rel: str,
    size: int | None,
    verify_data_crc: bool = True,
    report: Report | None = None,
) -> FileItems:
    """Scan one file through an fsspec filesystem (thread-safe), telling ``report`` the
    bytes read as they are."""
    tally = Tally(report)
    try:
        if size is None:  # an HTTP listing's: the object's own HEAD says
            size = fresh_info(fs, path).get("size")
        # One GET: one version of the object (GCS, S3 and memory answer it whole). At
        # most one byte more than listed: an object grown since (to gigabytes, perhaps)
        # is not held whole, but read by blocks as large ones are; so is an empty one (a
        # range of it is refused).
        data = fs.cat_file(path, start=0, end=size + 1) if size and size <= SMALL_REMOTE else None
        if data is not None and len(data) == size:
            with io.BytesIO(data) as f:
                items = scan(kind, f, rel, verify_data_crc, tally=tally)
        else:
            data = None
            items = _scan_version(fs, kind, path, rel, verify_data_crc, tally)
        items.end_file()
        tally.file_done(size)
        tally.flush()
        return items
    except ScanError:
        raise
    except Exception as e:  # backends raise many types (aiohttp, gcsfs, OSError)
        raise ScanError(f"cannot read {rel}: {type(e).__name__}: {e}") from None
