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
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

MAGIC = b"MLCDIGST"
VERSION = 1
# magic, version, kind, flags, root_len, count, npaths, strings_len,
# meta_len, reserved, total_len, reserved, header_crc32  (64 bytes)
_HEADER = struct.Struct("<8sHBBIQQQIIQII")
_VERSION_END = 10  # magic + version: the only bytes every version keeps
TRAILER_SIZE = 32
FINGERPRINT_DOMAIN = b"mlcache/fingerprint/v1\x00"

_U8 = np.dtype("<u8")
_U4 = np.dtype("<u4")


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
    trailer: int
    total: int


def _layout(root_len: int, meta_len: int, count: int, npaths: int, strings_len: int) -> _Layout:
    # Section offsets follow from the header alone; arrays start 8-aligned.
    root = _HEADER.size
    meta = root + root_len
    hashes = _pad8(meta + meta_len)
    sizes = hashes + 32 * count
    offsets = sizes + 8 * count
    path_index = offsets + 8 * count
    path_offsets = _pad8(path_index + 4 * count)
    strings = path_offsets + 8 * (npaths + 1)
    trailer = _pad8(strings + strings_len)
    return _Layout(root, meta, hashes, sizes, offsets, path_index, path_offsets,
                   strings, trailer, trailer + TRAILER_SIZE)


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


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
    ) -> None:
        # Low level: prefer Digest.load / Digest.from_arrays / DigestBuilder.
        self.root = root
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
    ) -> Digest:
        """Build from columns: ``hashes`` is (n, 32) uint8 (or n*32 bytes),
        ``path_index[i]`` indexes ``paths`` (de-duplicated relative paths)."""
        if isinstance(hashes, (bytes, bytearray)):
            h = np.frombuffer(hashes, np.uint8)
        else:
            h = np.asarray(hashes, np.uint8)
        h = _readonly(np.ascontiguousarray(h.reshape(-1, 32)))
        encoded = [p.encode("utf-8") for p in paths]
        poff = np.zeros(len(encoded) + 1, _U8)
        np.cumsum(np.fromiter((len(e) for e in encoded), _U8, len(encoded)), out=poff[1:])
        return cls(
            root, kind, h,
            _readonly(np.ascontiguousarray(sizes, _U8)),
            _readonly(np.ascontiguousarray(offsets, _U8)),
            _readonly(np.ascontiguousarray(path_index, _U4)),
            _readonly(poff), b"".join(encoded), meta,
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
        """Creation metadata (created, tool, ...); informational only."""
        return dict(self._meta)

    @cached_property
    def total_bytes(self) -> int:
        return int(self._sizes.sum(dtype=np.uint64))

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
        root = self.root.encode("utf-8")
        meta = json.dumps(self._meta, sort_keys=True, separators=(",", ":")).encode("utf-8")
        strings = self._strings
        n, npaths = len(self), self.num_paths
        lay = _layout(len(root), len(meta), n, npaths, len(strings))
        buf = bytearray(lay.total)
        head = _HEADER.pack(MAGIC, VERSION, _KIND_CODE[self.kind], 0, len(root), n, npaths,
                            len(strings), len(meta), 0, lay.total, 0, 0)
        head = head[:-4] + struct.pack("<I", zlib.crc32(head[:-4]))
        out = np.frombuffer(buf, np.uint8)
        for pos, blob in (
            (0, head), (lay.root, root), (lay.meta, meta),
            (lay.hashes, self._hashes), (lay.sizes, self._sizes),
            (lay.offsets, self._offsets), (lay.path_index, self._path_index),
            (lay.path_offsets, self._path_offsets), (lay.strings, strings),
        ):
            if isinstance(blob, np.ndarray):
                b = blob.view(np.uint8).reshape(-1)
            else:
                b = np.frombuffer(blob, np.uint8)
            out[pos:pos + len(b)] = b
        buf[lay.trailer:] = hashlib.sha256(memoryview(buf)[:lay.trailer]).digest()
        return bytes(buf)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically (temp file + rename): readers never see half a file."""
        path = Path(path)
        data = self.to_bytes()
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise

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
        if version != VERSION:
            raise DigestError(
                f"unsupported version {version} of digest file {name} (this reader supports {VERSION})"
            )
        if n < _HEADER.size:
            raise DigestError(f"truncated digest file {name}: {n} bytes, header needs {_HEADER.size}")
        (_, _, kind_code, flags, root_len, count, npaths, strings_len, meta_len,
         _r1, total_len, _r2, head_crc) = _HEADER.unpack_from(data)
        if zlib.crc32(data[: _HEADER.size - 4]) != head_crc:
            raise DigestError(f"corrupt digest file {name}: header checksum mismatch")
        lay = _layout(root_len, meta_len, count, npaths, strings_len)
        if lay.total != total_len or flags or kind_code not in _CODE_KIND:
            raise DigestError(f"corrupt digest file {name}: inconsistent header")
        if n < total_len:
            raise DigestError(f"truncated digest file {name}: {n} of {total_len} bytes")
        if n > total_len:
            raise DigestError(f"corrupt digest file {name}: {n - total_len} unexpected bytes after the end")
        mv = memoryview(data)
        if hashlib.sha256(mv[: lay.trailer]).digest() != data[lay.trailer:]:
            raise DigestError(f"corrupt digest file {name}: checksum mismatch")
        try:
            root = bytes(mv[lay.root: lay.root + root_len]).decode("utf-8")
            meta = json.loads(bytes(mv[lay.meta: lay.meta + meta_len]))
            if not isinstance(meta, dict):
                raise ValueError("metadata is not an object")

            def arr(dtype: Any, pos: int, count_: int) -> np.ndarray:
                return np.frombuffer(data, dtype, count_, pos)  # zero-copy, read-only

            return cls(
                root, _CODE_KIND[kind_code],
                arr(np.uint8, lay.hashes, 32 * count).reshape(count, 32),
                arr(_U8, lay.sizes, count), arr(_U8, lay.offsets, count),
                arr(_U4, lay.path_index, count), arr(_U8, lay.path_offsets, npaths + 1),
                mv[lay.strings: lay.strings + strings_len], meta,
            )
        except DigestError as e:
            raise DigestError(f"{e} ({name})") from None
        except ValueError as e:  # bad UTF-8 / JSON: only a buggy writer gets here
            raise DigestError(f"corrupt digest file {name}: {e}") from None


class DigestBuilder:
    """Accumulates items in order, interning paths, then builds a Digest."""

    def __init__(self, root: str, kind: Kind | str, meta: Mapping[str, str] | None = None) -> None:
        self.root = root
        self.kind = Kind(kind)
        self.meta = dict(meta or {})
        self._hashes = bytearray()
        self._sizes: list[int] = []
        self._offsets: list[int] = []
        self._pidx: list[int] = []
        self._paths: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._sizes)

    def add(self, sha256: bytes, size: int, path: str, offset: int = 0) -> None:
        if len(sha256) != 32:
            raise ValueError("sha256 must be 32 bytes")
        if size < 0 or offset < 0:
            raise ValueError("size and offset must be non-negative")
        self._hashes += sha256
        self._sizes.append(size)
        self._offsets.append(offset)
        self._pidx.append(self._paths.setdefault(path, len(self._paths)))

    def build(self) -> Digest:
        return Digest.from_arrays(
            self.root, self.kind, bytes(self._hashes), self._sizes, self._offsets,
            self._pidx, list(self._paths), self.meta,
        )


def _item_range(digest: Digest, i: int, base: str) -> tuple[str, int | None, int | None]:
    """(full path, start, end) of item i's read: whole files are read whole, so a
    grown file is noticed by the size check."""
    path, offset, length = digest.location(i)
    full = f"{base.rstrip('/')}/{path}"
    if digest.kind is Kind.FILES:
        return full, None, None
    return full, offset, offset + length


def _check_item(digest: Digest, i: int, data: bytes, verify: bool) -> bytes:
    length = int(digest.size(i))
    if verify and (len(data) != length or hashlib.sha256(data).digest() != digest.sha256(i)):
        path, offset, _ = digest.location(i)
        raise ItemMismatch(f"item {i} ({path} @ {offset}+{length}) does not match the digest")
    return data


def read_item(
    digest: Digest, i: int, fs: Any = None, *, verify: bool = False, **storage_options: Any
) -> bytes:
    """Read item ``i`` from the store under ``digest.root`` through fsspec.

    ``fs`` is an fsspec filesystem for the root's protocol; when omitted it
    comes from ``fsspec.core.url_to_fs(root, **storage_options)``.  Records use
    one range read.  With ``verify``, a content mismatch raises ItemMismatch.
    """
    import fsspec  # lazy: loading digests must not need the storage stack

    if fs is None:
        fs, base = fsspec.core.url_to_fs(digest.root, **storage_options)
    else:
        base = fs._strip_protocol(digest.root)
    full, start, end = _item_range(digest, i, base)
    if start is not None and start == end:
        data = b""
    else:
        data = fs.cat_file(full, start=start, end=end)
    return _check_item(digest, i, data, verify)


def read_items(digest: Digest, indices: Sequence[int], fs: Any, *, verify: bool = False,
               concurrency: int = 16, pool: Executor | None = None) -> list[bytes]:
    """Read several items, at most ``concurrency`` at a time; the first failure raises.

    An async filesystem (http, gcs, s3) reads the whole batch in one call on its
    event loop (``cat_ranges``): per item that costs about half the client CPU
    of one blocking ``cat_file`` per thread (tools/bench/misspath). Others
    (local) read in ``pool`` when given, else one after another."""
    indices = list(indices)
    if len(indices) <= 1 or not getattr(fs, "async_impl", False):
        if len(indices) > 1 and pool is not None:
            return list(pool.map(lambda i: read_item(digest, i, fs, verify=verify), indices))
        return [read_item(digest, i, fs, verify=verify) for i in indices]
    base = fs._strip_protocol(digest.root)
    ranges = [_item_range(digest, i, base) for i in indices]
    want = [p for p, (_, s, e) in enumerate(ranges) if s is None or s != e]
    got = fs.cat_ranges([ranges[p][0] for p in want], [ranges[p][1] for p in want],
                        [ranges[p][2] for p in want], batch_size=max(1, concurrency), on_error="return")
    out: list[bytes] = [b""] * len(indices)
    for p, data in zip(want, got):
        if isinstance(data, BaseException):
            raise data
        out[p] = data
    return [_check_item(digest, i, data, verify) for i, data in zip(indices, out)]
