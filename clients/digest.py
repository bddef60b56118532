"""Digest files: the hashes and store locations of every item of a dataset.

Holding a digest is the capability to read its items from the cache (see
docs/security.md).  The binary layout is specified in docs/digest-format.md;
this module is the reference reader/writer.  Item columns are numpy arrays
mapped straight onto the file bytes, so loading a million entries costs one
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
from array import array
from collections.abc import Mapping, Sequence
from functools import cached_property
from itertools import repeat
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from clients.digest_paths import bad_path, path_problem

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
FINGERPRINT_DOMAIN = b"mlcache/fingerprint/v1\x00"

_U8 = np.dtype("<u8")
_U4 = np.dtype("<u4")
_I8 = np.dtype("<i8")


class DigestError(ValueError):
    """A digest file is truncated, foreign, of an unsupported version or corrupt."""


class ItemMismatch(ValueError):
    """Bytes read from the store do not match the digest."""


class Kind(enum.StrEnum):
    """How items are cut out of the files under the root URL."""

    FILES = "files"  # each file is one item
    TFRECORD = "tfrecord"  # each record of TFRecord files is one item
    TAR = "tar"  # each regular member of (WebDataset) tar shards is one item


_KIND_CODE = {Kind.FILES: 1, Kind.TFRECORD: 2, Kind.TAR: 3}
_CODE_KIND = {v: k for k, v in _KIND_CODE.items()}


class Location(NamedTuple):
    """Where an item lives: ``path`` relative to the root URL, byte range."""

    path: str
    offset: int
    length: int


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


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _packed(strings: Sequence[str]) -> tuple[np.ndarray, bytes]:
    """(u8 bounds, n + 1 of them; UTF-8 blob) of a string column: the path and name tables."""
    encoded = [t.encode("utf-8") for t in strings]
    bounds = np.zeros(len(encoded) + 1, _U8)
    np.cumsum(np.fromiter((len(e) for e in encoded), _U8, len(encoded)), out=bounds[1:])
    return _readonly(bounds), b"".join(encoded)


def _extras(targets: Sequence[int] | np.ndarray | None, classes: Sequence[str],
            names: Sequence[str] | None, blake3: np.ndarray | bytes | None = None) -> Extras:
    t = None if targets is None else _readonly(np.ascontiguousarray(targets, _I8))
    no, blob = None, b""
    if names is not None:
        no, blob = _packed(names)
    if classes and t is None:
        raise ValueError("classes given without targets")
    b3 = None
    if blake3 is not None:
        raw = np.frombuffer(blake3, np.uint8) if isinstance(blake3, (bytes, bytearray)) else np.asarray(blake3, np.uint8)
        b3 = _readonly(np.ascontiguousarray(raw.reshape(-1, 32)))
    return Extras(t, tuple(classes), no, blob, b3)


class Digest:
    """An immutable, loaded digest.  Item ``i`` is addressed by its position."""

    def __init__(
        self,
        root: str,
        kind: Kind | str,
        hashes: np.ndarray,
        sizes: np.ndarray,
        offsets: np.ndarray,
        path_index: np.ndarray,
        path_offsets: np.ndarray,
        strings: bytes | memoryview,
        meta: Mapping[str, str] | None = None,
        extras: Extras | None = None,
    ) -> None:
        # Low level: prefer Digest.load / Digest.from_arrays / DigestBuilder.
        self.root = root
        self._extras = extras or Extras()
        self.kind = Kind(kind)
        self._meta = dict(meta or {})
        self._hashes = hashes
        self._sizes = sizes
        self._offsets = offsets
        self._path_index = path_index
        self._path_offsets = path_offsets
        self._strings = memoryview(strings)
        n = len(hashes)
        if not (hashes.shape == (n, 32) and len(sizes) == len(offsets) == len(path_index) == n):
            raise DigestError("corrupt digest: item columns differ in length")
        npaths = len(path_offsets) - 1
        if npaths < 0 or int(path_offsets[0]) != 0 or int(path_offsets[-1]) != len(self._strings):
            raise DigestError("corrupt digest: bad path table bounds")
        if npaths and np.any(path_offsets[1:] < path_offsets[:-1]):
            raise DigestError("corrupt digest: path table offsets not increasing")
        if n and int(path_index.max()) >= npaths:
            raise DigestError("corrupt digest: item refers to a missing path")
        self._extras.check(n)
        self._check_paths()

    def _check_paths(self) -> None:
        bad = bad_path(self._strings, self._path_offsets)
        if bad is not None:
            j, path, why = bad
            users = np.flatnonzero(self._path_index == j)
            item = f"item {int(users[0])}" if len(users) else f"path entry {j}"
            raise DigestError(f"{item}: path {path!r} {why}; entries must stay under the root")

    # -- construction -------------------------------------------------------

    @classmethod
    def from_arrays(
        cls,
        root: str,
        kind: Kind | str,
        hashes: np.ndarray | bytes,
        sizes: Sequence[int] | np.ndarray,
        offsets: Sequence[int] | np.ndarray,
        path_index: Sequence[int] | np.ndarray,
        paths: Sequence[str],
        meta: Mapping[str, str] | None = None,
        *,
        targets: Sequence[int] | np.ndarray | None = None,
        classes: Sequence[str] = (),
        names: Sequence[str] | None = None,
        blake3: np.ndarray | bytes | None = None,
    ) -> Digest:
        """Build from columns: ``hashes`` is (n, 32) uint8 (or n*32 bytes),
        ``path_index[i]`` indexes ``paths`` (de-duplicated relative paths).
        Optional (format version 2): ``targets`` per item (class indices into
        ``classes`` when classes are given, else the user's integers) and
        ``names`` per item (tar member names). Optional (version 3): ``blake3``, (n, 32)
        uint8 (or n*32 bytes), each item's BLAKE3: clients check cached values
        against it, several times faster than SHA-256 (docs/security.md)."""
        if isinstance(hashes, (bytes, bytearray)):
            h = np.frombuffer(hashes, np.uint8)
        else:
            h = np.asarray(hashes, np.uint8)
        h = _readonly(np.ascontiguousarray(h.reshape(-1, 32)))
        poff, strings = _packed(paths)
        return cls(
            root, kind, h,
            _readonly(np.ascontiguousarray(sizes, _U8)),
            _readonly(np.ascontiguousarray(offsets, _U8)),
            _readonly(np.ascontiguousarray(path_index, _U4)),
            poff, strings, meta, _extras(targets, classes, names, blake3),
        )

    # -- item access ----------------------------------------------------------

    def __len__(self) -> int:
        return len(self._hashes)

    def __reduce__(self) -> tuple[Any, tuple[bytes, str]]:
        # Picklable (e.g. into DataLoader workers) as its own file bytes.
        return Digest.from_bytes, (self.to_bytes(), "<pickle>")

    def __repr__(self) -> str:
        return f"<Digest {self.kind.value} {self.root!r} items={len(self)} bytes={self.total_bytes}>"

    def index(self, i: int) -> int:
        """Item i as an index in range (negative counts from the end); IndexError names the range."""
        return self._idx(i)

    def _idx(self, i: int) -> int:
        n = len(self)
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError(f"item {i} out of range for digest of {n} items")
        return j

    def sha256(self, i: int) -> bytes:
        """The 32-byte SHA-256 of item ``i`` (its content key K)."""
        return self._hashes[self._idx(i)].tobytes()

    def size(self, i: int) -> int:
        return int(self._sizes[self._idx(i)])

    def location(self, i: int) -> Location:
        i = self._idx(i)
        return Location(self.path(int(self._path_index[i])), int(self._offsets[i]), int(self._sizes[i]))

    def path(self, j: int) -> str:
        """Entry ``j`` of the path table (not item ``j``)."""
        a, b = int(self._path_offsets[j]), int(self._path_offsets[j + 1])
        return bytes(self._strings[a:b]).decode("utf-8")

    @property
    def num_paths(self) -> int:
        return len(self._path_offsets) - 1

    @property
    def paths(self) -> list[str]:
        """All distinct relative paths (decodes the whole table)."""
        return [self.path(j) for j in range(self.num_paths)]

    @property
    def hashes(self) -> np.ndarray:
        """Read-only (n, 32) uint8 view of all item hashes."""
        return self._hashes

    @property
    def sizes(self) -> np.ndarray:
        return self._sizes

    @property
    def offsets(self) -> np.ndarray:
        return self._offsets

    @property
    def path_index(self) -> np.ndarray:
        return self._path_index

    @property
    def meta(self) -> dict[str, str]:
        """Creation metadata (created, tool, ...); informational, but for an HTTP digest's
        tool (digest_paths.listed_names)."""
        return dict(self._meta)

    @property
    def version(self) -> int:
        """The format version this digest is written in: the oldest that holds its columns
        (1 plain, 2 with targets or names, 3 with BLAKE3), so older readers read what they can."""
        flags = self._extras.flags
        return 3 if flags & FLAG_BLAKE3 else 2 if flags else 1

    @property
    def blake3(self) -> np.ndarray | None:
        """Read-only (n, 32) uint8 BLAKE3 of each item (version 3), or None: the fast
        check of a cached value; the SHA-256 stays the key and capability."""
        return self._extras.blake3

    @property
    def targets(self) -> np.ndarray | None:
        """Read-only i8 column of per-item targets (version 2), or None."""
        return self._extras.targets

    def target(self, i: int) -> int:
        t = self._extras.targets
        if t is None:
            raise LookupError("this digest records no targets (make it with tools/digest --targets)")
        return int(t[self._idx(i)])

    @property
    def classes(self) -> list[str]:
        """Class names, indexed by target (empty when targets are the user's own integers)."""
        return list(self._extras.classes)

    def class_name(self, target: int) -> str | None:
        """The class that a target value names; None when the targets are the user's integers."""
        classes = self._extras.classes
        return classes[target] if classes else None

    @property
    def has_names(self) -> bool:
        return self._extras.name_offsets is not None

    def name(self, i: int) -> str:
        """Item ``i``'s name within its file (a tar member's name), version 2."""
        no = self._extras.name_offsets
        if no is None:
            raise LookupError("this digest records no item names (made before format version 2)")
        i = self._idx(i)
        return bytes(memoryview(self._extras.names)[int(no[i]):int(no[i + 1])]).decode("utf-8")

    @cached_property
    def total_bytes(self) -> int:
        return int(self._sizes.sum(dtype=np.uint64))

    @cached_property
    def largest(self) -> int:
        """The largest item's size in bytes (0 for no items)."""
        return int(self._sizes.max()) if len(self._sizes) else 0

    @cached_property
    def fingerprint(self) -> bytes:
        """Dataset identity: SHA-256(domain || d_0 || ... || d_{n-1}).

        Independent of root, kind and locations, so copies of the same data in
        different buckets share a fingerprint."""
        h = hashlib.sha256(FINGERPRINT_DOMAIN)
        h.update(self._hashes.data)
        return h.digest()

    # -- serialisation --------------------------------------------------------

    def to_bytes(self) -> bytes:
        """The file's bytes: version 1 when there are no targets or names (so older
        readers still read it), else version 2."""
        return bytes(self._file_buffer())

    def _file_buffer(self) -> bytearray:
        """to_bytes's bytes, not copied into a bytes object (save writes them as they are)."""
        root = self.root.encode("utf-8")
        meta = json.dumps(self._meta, sort_keys=True, separators=(",", ":")).encode("utf-8")
        strings = self._strings
        ex = self._extras
        classes = json.dumps(list(ex.classes)).encode("utf-8") if ex.targets is not None else b""
        if len(classes) > 0xFFFFFFFF or len(ex.names) > 0xFFFFFFFF:
            raise ValueError("class or item names exceed the format's 4 GiB limit")
        n, npaths = len(self), self.num_paths
        lay = _layout(len(root), len(meta), n, npaths, len(strings), ex.flags, len(classes), len(ex.names))
        buf = bytearray(lay.total)
        head = _HEADER.pack(MAGIC, self.version, _KIND_CODE[self.kind], ex.flags, len(root), n, npaths,
                            len(strings), len(meta), len(classes), lay.total, len(ex.names), 0)
        head = head[:-4] + struct.pack("<I", zlib.crc32(head[:-4]))
        out = np.frombuffer(buf, np.uint8)
        for pos, blob in (
            (0, head), (lay.root, root), (lay.meta, meta),
            (lay.hashes, self._hashes), (lay.sizes, self._sizes),
            (lay.offsets, self._offsets), (lay.path_index, self._path_index),
            (lay.path_offsets, self._path_offsets), (lay.strings, strings),
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

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically (temp file + rename): readers never see half a file, and a crash
        (power loss included: the data reaches the disk before the rename) leaves the old
        digest or the new one, never an empty file in place of a good one."""
        path = Path(path)
        data = self._file_buffer()
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

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Digest:
        return cls.from_bytes(Path(path).read_bytes(), str(path))

    @classmethod
    def from_bytes(cls, data: bytes, name: str = "<bytes>") -> Digest:
        """Parse and check a digest; raises DigestError saying what is wrong."""
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
        mv = memoryview(data)
        if hashlib.sha256(mv[: lay.trailer]).digest() != data[lay.trailer:]:
            raise DigestError(f"corrupt digest file {name}: checksum mismatch")
        try:
            return cls._parse(data, lay, _CODE_KIND[kind_code], flags,
                              (root_len, meta_len, count, npaths, strings_len, classes_len, names_len))
        except DigestError as e:
            raise DigestError(f"{e} ({name})") from None
        except ValueError as e:  # bad UTF-8 / JSON: only a buggy writer gets here
            raise DigestError(f"corrupt digest file {name}: {e}") from None

    @classmethod
    def _parse(cls, data: bytes, lay: _Layout, kind: Kind, flags: int, lens: tuple[int, ...]) -> Digest:
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
            extras = extras._replace(targets=arr(_I8, lay.targets, count), classes=tuple(classes))
        if flags & FLAG_NAMES:
            extras = extras._replace(name_offsets=arr(_U8, lay.name_offsets, count + 1),
                                     names=mv[lay.names: lay.names + names_len])
        if flags & FLAG_BLAKE3:
            extras = extras._replace(blake3=arr(np.uint8, lay.blake3, 32 * count).reshape(count, 32))
        return cls(
            root, kind,
            arr(np.uint8, lay.hashes, 32 * count).reshape(count, 32),
            arr(_U8, lay.sizes, count), arr(_U8, lay.offsets, count),
            arr(_U4, lay.path_index, count), arr(_U8, lay.path_offsets, npaths + 1),
            mv[lay.strings: lay.strings + strings_len], meta, extras,
        )


class DigestBuilder:
    """Accumulates items in order, interning paths, then builds a Digest. Columns are kept
    packed (about 90 bytes an item), so millions of items fit in little memory."""

    def __init__(self, root: str, kind: Kind | str, meta: Mapping[str, str] | None = None) -> None:
        self.root = root
        self.kind = Kind(kind)
        self.meta = dict(meta or {})
        self._hashes = bytearray()
        self._sizes = array("Q")
        self._offsets = array("Q")
        self._pidx = array("I")  # u4 (build converts, whatever the C int size)
        self._paths: dict[str, int] = {}
        self._names = bytearray()  # UTF-8 names, concatenated
        self._name_ends: array[int] | None = None  # end of each item's name; None: no names
        self._blake3 = bytearray()

    def __len__(self) -> int:
        return len(self._sizes)

    def add(self, sha256: bytes, size: int, path: str, offset: int = 0, name: str | None = None,
            blake3: bytes | None = None) -> None:
        """Append an item; ``name`` (a tar member's name) and ``blake3`` (its BLAKE3,
        the fast check of cached values) are each given for all items or none."""
        self.add_many(path, sha256, (size,), (offset,), None if name is None else (name,), blake3)

    def add_many(self, path: str, sha256: bytes | bytearray, sizes: Sequence[int], offsets: Sequence[int],
                 names: Sequence[str] | None = None, blake3: bytes | bytearray | None = None) -> None:
        """Append the items of one file at once: as ``add``, with ``sha256`` and ``blake3``
        each the items' hashes concatenated (32 bytes an item)."""
        n = len(sizes)
        if not n:
            return
        if (names is None) != (self._name_ends is None) and self._sizes:
            raise ValueError("give a name for every item or for none")
        if (blake3 is None) != (not self._blake3) and self._sizes:
            raise ValueError("give a BLAKE3 for every item or for none")
        if blake3 is not None and len(blake3) != 32 * n:
            raise ValueError(f"blake3 must be 32 bytes an item, got {len(blake3)} for {n}")
        if len(sha256) != 32 * n:
            raise ValueError(f"sha256 must be 32 bytes an item, got {len(sha256)} for {n}")
        if len(offsets) != n or (names is not None and len(names) != n):
            raise ValueError("give as many offsets and names as sizes")
        if min(sizes) < 0 or min(offsets) < 0:
            raise ValueError("size and offset must be non-negative")
        why = path_problem(path)
        if why:
            raise DigestError(f"item {len(self._sizes)}: path {path!r} {why}; entries must stay under the root")
        self._hashes += sha256
        self._sizes.extend(sizes)
        self._offsets.extend(offsets)
        self._pidx.extend(repeat(self._paths.setdefault(path, len(self._paths)), n))
        if names is not None:
            ends = self._name_ends = self._name_ends if self._name_ends is not None else array("Q")
            for name in names:
                self._names += name.encode("utf-8")
                ends.append(len(self._names))
        if blake3 is not None:
            self._blake3 += blake3

    def item_paths(self) -> list[str]:
        """Each item's relative path, in order (e.g. to derive targets from)."""
        paths = list(self._paths)
        return [paths[j] for j in self._pidx]

    def path_table(self) -> tuple[list[str], np.ndarray]:
        """The distinct paths, and each item's index into them."""
        return list(self._paths), np.array(self._pidx, _U4)

    def build(self, targets: Sequence[int] | np.ndarray | None = None, classes: Sequence[str] = ()) -> Digest:
        poff, strings = _packed(list(self._paths))
        extras = _extras(targets, classes, None, bytes(self._blake3) if self._blake3 else None)
        if self._name_ends is not None:
            ends = np.zeros(len(self._name_ends) + 1, _U8)
            ends[1:] = self._name_ends
            extras = extras._replace(name_offsets=_readonly(ends), names=bytes(self._names))
        hashes = np.frombuffer(bytes(self._hashes), np.uint8).reshape(-1, 32)  # read-only: of bytes
        return Digest(self.root, self.kind, hashes, _readonly(np.array(self._sizes, _U8)),
                      _readonly(np.array(self._offsets, _U8)), _readonly(np.array(self._pidx, _U4)),
                      poff, strings, self.meta, extras)
