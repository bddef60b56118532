"""Find and hash the items inside one data file: the unit of work of tools/digest.

An item is ``(offset, size, sha256, name, blake3)``: the whole file for the ``files``
kind, the data of each record for ``tfrecord``, the data of each regular member
for ``tar`` (whose member name is kept, for WebDataset sample grouping; None
otherwise); blake3 is the fast check of cached values (digest format 3).  Everything here works on any seekable binary file object, so the
same code serves local files (in worker processes) and fsspec files (in
threads).  This module stays free of heavy imports because worker processes
import it.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import threading
from collections.abc import Iterator
from typing import Any, BinaryIO

import blake3

from clients.tfrecord import RecordError, iter_records

Item = tuple[int, int, bytes, str | None, bytes]  # (offset, size, sha256, tar member name, blake3)

CHUNK = 1024 * 1024  # measured: 1 MiB reads beat 64-256 KiB (fewer syscalls)
SMALL_REMOTE = 32 * 1024 * 1024  # remote files up to this size: one GET
REMOTE_BLOCK = 8 * 1024 * 1024

KINDS = ("files", "tfrecord", "tar")


class ScanError(Exception):
    """An item could not be read or parsed; the message names the file."""


_local = threading.local()


def _read_buffer() -> memoryview:
    # One buffer per thread, reused: no 1 MiB allocation and zero-fill per file.
    mv = getattr(_local, "buf", None)
    if mv is None:
        mv = _local.buf = memoryview(bytearray(CHUNK))
    return mv


def hash_stream(f: BinaryIO, limit: int | None = None, also: Any = None) -> tuple[bytes, int]:
    """SHA-256 and length of the next ``limit`` bytes of ``f`` (all if None); ``also``
    (a BLAKE3 hasher) is fed the same bytes."""
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
        total += n
    return h.digest(), total


def scan_whole(f: BinaryIO, name: str) -> list[Item]:
    b3 = blake3.blake3()
    sha, size = hash_stream(f, also=b3)
    return [(0, size, sha, None, b3.digest())]


def scan_tfrecord(f: BinaryIO, name: str, verify_data_crc: bool = True) -> list[Item]:
    return [
        (off, len(data), hashlib.sha256(data).digest(), None, blake3.blake3(data).digest())
        for off, data in iter_records(f, name, verify_data_crc)
    ]


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


def scan_tar(f: BinaryIO, name: str) -> list[Item]:
    try:
        tf = tarfile.open(fileobj=f, mode="r:")
    except tarfile.ReadError as e:
        raise ScanError(
            f"{name}: not an uncompressed tar archive ({e}); "
            "compressed shards cannot be range-read"
        ) from None
    items: list[Item] = []
    end = 0
    for m in _members(tf, name):
        end = m.offset_data + ((m.size + 511) // 512) * 512
        if not m.isreg():
            continue  # directories, links, ...: no data of their own
        if m.issparse():
            raise ScanError(f"{name}: sparse member {m.name!r} cannot be range-read")
        f.seek(m.offset_data)
        b3 = blake3.blake3()
        sha, n = hash_stream(f, m.size, also=b3)
        if n != m.size:
            raise ScanError(
                f"{name}: truncated member {m.name!r} at offset {m.offset_data}"
            )
        items.append((m.offset_data, m.size, sha, m.name, b3.digest()))
    # tarfile silently stops at a bad or missing header; a real archive ends
    # with a zero block, so anything else means truncation or garbage.
    f.seek(end)
    if f.read(512) != bytes(512):
        raise ScanError(
            f"{name}: no end-of-archive marker at offset {end} (truncated or corrupt tar)"
        )
    return items


def scan(kind: str, f: BinaryIO, name: str, verify_data_crc: bool = True) -> list[Item]:
    """Items of one file of the given kind; raises ScanError on bad data."""
    try:
        if kind == "files":
            return scan_whole(f, name)
        if kind == "tfrecord":
            return scan_tfrecord(f, name, verify_data_crc)
        if kind == "tar":
            return scan_tar(f, name)
    except RecordError as e:
        raise ScanError(str(e)) from None
    raise ValueError(f"unknown kind {kind!r}")


def scan_local_batch(
    kind: str, files: list[tuple[str, str]], verify_data_crc: bool = True
) -> list[list[Item]]:
    """Worker-process entry: scan local ``(abspath, relpath)`` files in order."""
    out = []
    for path, rel in files:
        try:
            # Unbuffered for whole files (readinto straight into our buffer);
            # buffered for the many small reads of record framing.
            with open(path, "rb", buffering=0 if kind == "files" else 1 << 20) as f:
                before = os.fstat(f.fileno())
                out.append(scan(kind, f, rel, verify_data_crc))
                after = os.fstat(f.fileno())
        except OSError as e:
            raise ScanError(f"cannot read {rel}: {e.strerror or e}") from None
        # A file still being written (a copy in progress) would leave hashes of
        # bytes that are gone by the time anyone reads them back.
        if (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns):
            raise ScanError(f"{rel} changed while it was read ({before.st_size} bytes, then "
                            f"{after.st_size}): digest it again once nothing is writing it")
    return out


def scan_remote(
    fs: Any,
    kind: str,
    path: str,
    rel: str,
    size: int | None,
    verify_data_crc: bool = True,
) -> list[Item]:
    """Scan one file through an fsspec filesystem (thread-safe)."""
    try:
        if size is not None and size <= SMALL_REMOTE:
            f: BinaryIO = io.BytesIO(fs.cat_file(path))  # one request, no HEAD
        else:
            f = fs.open(path, "rb", block_size=REMOTE_BLOCK)
        with f:
            return scan(kind, f, rel, verify_data_crc)
    except ScanError:
        raise
    except Exception as e:  # backends raise many types (aiohttp, gcsfs, OSError)
        raise ScanError(f"cannot read {rel}: {type(e).__name__}: {e}") from None
