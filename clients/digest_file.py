"""The digest file's bytes: header, section layout, optional columns, and the
encoder and decoder clients/digest.py's Digest is written and read with.

The binary layout is specified in docs/digest-format.md. Item columns are numpy
arrays mapped straight onto the file bytes, so loading a million entries costs one
read and one checksum, not a Python loop.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import struct
import tempfile
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

MAGIC = b"MLCDIGST"
VERSION = 3  # the newest this module reads and writes; see VERSIONS
VERSIONS = (1, 2, 3)  # 2 adds the optional targets and names columns, 3 the BLAKE3 column
# magic, version, kind, flags, root_len, count, npaths, strings_len,
# meta_len, classes_len, total_len, names_len, header_crc32  (64 bytes;
# in version 1 classes_len and names_len are reserved, 0)
_HEADER = struct.Struct("<8sHBBIQQQIIQII")
FLAG_TARGETS = 1  # version 2: a per-item i8 target column and the class names
FLAG_NAMES = 2    # version 2: a per-item name (the tar member name) column
FLAG_BLAKE3 = 4   # version 3: a per-item BLAKE3 column, the fast check of cached values
_VERSION_END = 10  # magic + version: the only bytes every version keeps
TRAILER_SIZE = 32

U8 = np.dtype("<u8")
U4 = np.dtype("<u4")
I8 = np.dtype("<i8")


class DigestError(ValueError):
    """A digest file is truncated, foreign, of an unsupported version or corrupt."""


class Kind(enum.StrEnum):
    """How items are cut out of the files under the root URL."""

    FILES = "files"  # each file is one item
    TFRECORD = "tfrecord"  # each record of TFRecord files is one item
    TAR = "tar"  # each regular member of (WebDataset) tar shards is one item


_KIND_CODE = {Kind.FILES: 1, Kind.TFRECORD: 2, Kind.TAR: 3}
_CODE_KIND = {v: k for k, v in _KIND_CODE.items()}


def _pad8(n: int) -> int:
    return (n + 7) & ~7


class _Layout(NamedTuple):
    root: int
    meta: int
    hashes: int
    sizes: int
    offsets: int
    path_index: int
    path_offsets: int
    strings: int
    targets: int
    classes: int
    name_offsets: int
    names: int
    blake3: int
    trailer: int
    total: int


def _layout(root_len: int, meta_len: int, count: int, npaths: int, strings_len: int,
            flags: int = 0, classes_len: int = 0, names_len: int = 0) -> _Layout:
    # Section offsets follow from the header alone; arrays start 8-aligned.
    root = _HEADER.size
    meta = root + root_len
    hashes = _pad8(meta + meta_len)
    sizes = hashes + 32 * count
    offsets = sizes + 8 * count
    path_index = offsets + 8 * count
    path_offsets = _pad8(path_index + 4 * count)
    strings = path_offsets + 8 * (npaths + 1)
    end = _pad8(strings + strings_len)
    targets = classes = end
    if flags & FLAG_TARGETS:
        classes = targets + 8 * count
        end = _pad8(classes + classes_len)
    name_offsets = names = end
    if flags & FLAG_NAMES:
        names = name_offsets + 8 * (count + 1)
        end = _pad8(names + names_len)
    blake3 = end
    if flags & FLAG_BLAKE3:
        end = blake3 + 32 * count
    return _Layout(root, meta, hashes, sizes, offsets, path_index, path_offsets,
                   strings, targets, classes, name_offsets, names, blake3, end, end + TRAILER_SIZE)


class Extras(NamedTuple):
    """Version 2's (and 3's) optional per-item columns (None when absent)."""

    targets: np.ndarray | None = None  # i8 per item
    classes: tuple[str, ...] = ()  # name of each target value, when it names a class
    name_offsets: np.ndarray | None = None  # u8, n + 1 bounds into names
    names: bytes | memoryview = b""  # UTF-8 names (tar member names) concatenated
    blake3: np.ndarray | None = None  # (n, 32) u8: BLAKE3 of each item (version 3)

    @property
    def flags(self) -> int:
        return (FLAG_TARGETS if self.targets is not None else 0) | (
            FLAG_NAMES if self.name_offsets is not None else 0) | (
            FLAG_BLAKE3 if self.blake3 is not None else 0)

    def check(self, n: int) -> None:
        if self.blake3 is not None and self.blake3.shape != (n, 32):
            raise DigestError("corrupt digest: BLAKE3 column differs in length")
        if self.targets is not None and self.targets.shape != (n,):
            raise DigestError("corrupt digest: target column differs in length")
        if self.targets is not None and self.classes and n and (
                int(self.targets.min()) < 0 or int(self.targets.max()) >= len(self.classes)):
            raise DigestError("corrupt digest: a target is not a class index")
        no = self.name_offsets
        if no is not None and (no.shape != (n + 1,) or int(no[0]) != 0 or int(no[-1]) != len(self.names)
                               or (n and np.any(no[1:] < no[:-1]))):
            raise DigestError("corrupt digest: bad name table bounds")


def readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def packed(strings: Sequence[str]) -> tuple[np.ndarray, bytes]:
    """(u8 bounds, n + 1 of them; UTF-8 blob) of a string column: the path and name tables."""
    encoded = [t.encode("utf-8") for t in strings]
    bounds = np.zeros(len(encoded) + 1, U8)
    np.cumsum(np.fromiter((len(e) for e in encoded), U8, len(encoded)), out=bounds[1:])
    return readonly(bounds), b"".join(encoded)


def make_extras(targets: Sequence[int] | np.ndarray | None, classes: Sequence[str],
            names: Sequence[str] | None, blake3: np.ndarray | bytes | None = None) -> Extras:
    t = None if targets is None else readonly(np.ascontiguousarray(targets, I8))
    no, blob = None, b""
    if names is not None:
        no, blob = packed(names)
    if classes and t is None:
        raise ValueError("classes given without targets")
    b3 = None
    if blake3 is not None:
        raw = np.frombuffer(blake3, np.uint8) if isinstance(blake3, (bytes, bytearray)) else np.asarray(blake3, np.uint8)
        b3 = readonly(np.ascontiguousarray(raw.reshape(-1, 32)))
    return Extras(t, tuple(classes), no, blob, b3)


class Parts(NamedTuple):
    """A file's contents, in the order Digest's constructor takes them."""

    root: str
    kind: Kind
    hashes: np.ndarray
    sizes: np.ndarray
    offsets: np.ndarray
    path_index: np.ndarray
    path_offsets: np.ndarray
    strings: bytes | memoryview
    meta: Mapping[str, str]
    extras: Extras


def version_of(flags: int) -> int:
    """The oldest format version that holds these columns (1 plain, 2 with targets or
    names, 3 with BLAKE3), so older readers read what they can."""
    return 3 if flags & FLAG_BLAKE3 else 2 if flags else 1


def encode(p: Parts) -> bytearray:
    """The file's bytes, in a bytearray (save writes them without a copy)."""
    root = p.root.encode("utf-8")
    meta = json.dumps(dict(p.meta), sort_keys=True, separators=(",", ":")).encode("utf-8")
    strings = p.strings
    ex = p.extras
    classes = json.dumps(list(ex.classes)).encode("utf-8") if ex.targets is not None else b""
    if len(classes) > 0xFFFFFFFF or len(ex.names) > 0xFFFFFFFF:
        raise ValueError("class or item names exceed the format's 4 GiB limit")
    n, npaths = len(p.hashes), len(p.path_offsets) - 1
    lay = _layout(len(root), len(meta), n, npaths, len(strings), ex.flags, len(classes), len(ex.names))
    buf = bytearray(lay.total)
    head = _HEADER.pack(MAGIC, version_of(ex.flags), _KIND_CODE[p.kind], ex.flags, len(root), n, npaths,
                        len(strings), len(meta), len(classes), lay.total, len(ex.names), 0)
    head = head[:-4] + struct.pack("<I", zlib.crc32(head[:-4]))
    out = np.frombuffer(buf, np.uint8)
    for pos, blob in (
        (0, head), (lay.root, root), (lay.meta, meta),
        (lay.hashes, p.hashes), (lay.sizes, p.sizes),
        (lay.offsets, p.offsets), (lay.path_index, p.path_index),
        (lay.path_offsets, p.path_offsets), (lay.strings, strings),
        (lay.targets, ex.targets), (lay.classes, classes),
        (lay.name_offsets, ex.name_offsets), (lay.names, ex.names), (lay.blake3, ex.blake3),
    ):
        if blob is None:
            continue
        if isinstance(blob, np.ndarray):
            b = blob.view(np.uint8).reshape(-1)
        else:
            b = np.frombuffer(blob, np.uint8)
        out[pos:pos + len(b)] = b
    buf[lay.trailer:] = hashlib.sha256(memoryview(buf)[:lay.trailer]).digest()
    return buf


def write_atomic(path: str | os.PathLike[str], data: bytes | bytearray) -> None:
    """Write atomically (temp file + rename): readers never see half a file, and a crash
    (power loss included: the data reaches the disk before the rename) leaves the old
    digest or the new one, never an empty file in place of a good one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    try:  # the rename itself
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass  # a directory that cannot be opened or synced (some network filesystems)


def decode(data: bytes, name: str = "<bytes>") -> Parts:
    """Parse and check a digest file's bytes; raises DigestError saying what is wrong."""
    n = len(data)
    if n < len(MAGIC) and MAGIC.startswith(data):
        raise DigestError(f"truncated digest file {name}: {n} bytes")
    if data[: len(MAGIC)] != MAGIC:
        raise DigestError(f"not a digest file: {name} (magic {bytes(data[:8])!r})")
    if n < _VERSION_END:
        raise DigestError(f"truncated digest file {name}: {n} bytes")
    (version,) = struct.unpack_from("<H", data, len(MAGIC))
    if version not in VERSIONS:
        raise DigestError(f"unsupported version {version} of digest file {name} "
                          f"(this reader supports {', '.join(map(str, VERSIONS))})")
    if n < _HEADER.size:
        raise DigestError(f"truncated digest file {name}: {n} bytes, header needs {_HEADER.size}")
    (_, _, kind_code, flags, root_len, count, npaths, strings_len, meta_len,
     classes_len, total_len, names_len, head_crc) = _HEADER.unpack_from(data)
    if zlib.crc32(data[: _HEADER.size - 4]) != head_crc:
        raise DigestError(f"corrupt digest file {name}: header checksum mismatch")
    known = (0, FLAG_TARGETS | FLAG_NAMES, FLAG_TARGETS | FLAG_NAMES | FLAG_BLAKE3)[version - 1]
    if (flags & ~known or (classes_len and not flags & FLAG_TARGETS)
            or (names_len and not flags & FLAG_NAMES)):
        raise DigestError(f"corrupt digest file {name}: inconsistent header")
    lay = _layout(root_len, meta_len, count, npaths, strings_len, flags, classes_len, names_len)
    if lay.total != total_len or kind_code not in _CODE_KIND:
        raise DigestError(f"corrupt digest file {name}: inconsistent header")
    if n < total_len:
        raise DigestError(f"truncated digest file {name}: {n} of {total_len} bytes")
    if n > total_len:
        raise DigestError(f"corrupt digest file {name}: {n - total_len} unexpected bytes after the end")
    if hashlib.sha256(memoryview(data)[: lay.trailer]).digest() != data[lay.trailer:]:
        raise DigestError(f"corrupt digest file {name}: checksum mismatch")
    try:
        return _parse(data, lay, _CODE_KIND[kind_code], flags,
                      (root_len, meta_len, count, npaths, strings_len, classes_len, names_len))
    except ValueError as e:  # bad UTF-8 / JSON: only a buggy writer gets here
        raise DigestError(f"corrupt digest file {name}: {e}") from None


def _parse(data: bytes, lay: _Layout, kind: Kind, flags: int, lens: tuple[int, ...]) -> Parts:
    """The sections of a file whose header and checksums passed."""
    root_len, meta_len, count, npaths, strings_len, classes_len, names_len = lens
    mv = memoryview(data)
    root = bytes(mv[lay.root: lay.root + root_len]).decode("utf-8")
    meta = json.loads(bytes(mv[lay.meta: lay.meta + meta_len]))
    if not isinstance(meta, dict):
        raise ValueError("metadata is not an object")

    def arr(dtype: Any, pos: int, count_: int) -> np.ndarray:
        return np.frombuffer(data, dtype, count_, pos)  # zero-copy, read-only

    extras = Extras()
    if flags & FLAG_TARGETS:
        classes = json.loads(bytes(mv[lay.classes: lay.classes + classes_len]))
        if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
            raise ValueError("class names are not a list of strings")
        extras = extras._replace(targets=arr(I8, lay.targets, count), classes=tuple(classes))
    if flags & FLAG_NAMES:
        extras = extras._replace(name_offsets=arr(U8, lay.name_offsets, count + 1),
                                 names=mv[lay.names: lay.names + names_len])
    if flags & FLAG_BLAKE3:
        extras = extras._replace(blake3=arr(np.uint8, lay.blake3, 32 * count).reshape(count, 32))
    return Parts(
        root, kind,
        arr(np.uint8, lay.hashes, 32 * count).reshape(count, 32),
        arr(U8, lay.sizes, count), arr(U8, lay.offsets, count),
        arr(U4, lay.path_index, count), arr(U8, lay.path_offsets, npaths + 1),
        mv[lay.strings: lay.strings + strings_len], meta, extras,
    )
