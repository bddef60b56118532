"""Digest files: the hashes and store locations of every item of a dataset.

Holding a digest is the capability to read its items from the cache (see
docs/security.md).  The binary layout is specified in docs/digest-format.md;
this module is the reference reader/writer: Digest and DigestBuilder here, the
file's bytes in digest_file.py (whose format names this module re-exports).
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections.abc import Mapping, Sequence
from functools import cached_property
from itertools import repeat
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from clients.digest_file import (
    FLAG_BLAKE3,
    FLAG_NAMES,
    FLAG_TARGETS,
    MAGIC,
    TRAILER_SIZE,
    U4,
    U8,
    VERSION,
    VERSIONS,
    DigestError,
    Extras,
    Kind,
    Parts,
    decode,
    encode,
    make_extras,
    packed,
    readonly,
    version_of,
    write_atomic,
)
from clients.digest_paths import bad_path, path_problem

# The format's names are re-exported: they were this module's before digest_file.py.
__all__ = ["FINGERPRINT_DOMAIN", "FLAG_BLAKE3", "FLAG_NAMES", "FLAG_TARGETS", "MAGIC", "TRAILER_SIZE",
           "VERSION", "VERSIONS", "Digest", "DigestBuilder", "DigestError", "Extras", "ItemMismatch",
           "Kind", "Location"]

FINGERPRINT_DOMAIN = b"mlcache/fingerprint/v1\x00"


class ItemMismatch(ValueError):
    """Bytes read from the store do not match the digest."""


class Location(NamedTuple):
    """Where an item lives: ``path`` relative to the root URL, byte range."""

    path: str
    offset: int
    length: int


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
        h = readonly(np.ascontiguousarray(h.reshape(-1, 32)))
        poff, strings = packed(paths)
        return cls(
            root, kind, h,
            readonly(np.ascontiguousarray(sizes, U8)),
            readonly(np.ascontiguousarray(offsets, U8)),
            readonly(np.ascontiguousarray(path_index, U4)),
            poff, strings, meta, make_extras(targets, classes, names, blake3),
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
        return version_of(self._extras.flags)

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
        """Item ``i``'s name within its file (a tar member's name), version 2. Only tar digests
        record names; LookupError says why this one has none."""
        no = self._extras.name_offsets
        i = self._idx(i)
        if no is None:
            raise LookupError(self._no_names(i))
        return bytes(memoryview(self._extras.names)[int(no[i]):int(no[i + 1])]).decode("utf-8")

    def _no_names(self, i: int) -> str:
        """Why item ``i`` has no name. A files or tfrecord digest never records names (an item is a
        whole file or a record: its location says which); the message blamed the format version,
        yet tools/digest writes such digests in version 3."""
        path, offset, _ = self.location(i)
        if self.kind is Kind.FILES:
            return (f"a files digest records no item names: item {i} is the whole file {path!r} "
                    "(Digest.location(i).path); only tar digests name their items (members)")
        if self.kind is Kind.TFRECORD:
            return (f"a tfrecord digest records no item names: item {i} is the record at byte {offset} of "
                    f"{path!r} (Digest.location(i)); only tar digests name their items (members)")
        why = "format version 1 predates them" if self.version == 1 else "its writer gave none"
        return f"this tar digest records no item names ({why}): remake it with tools/digest --format tar"

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
        """The file's bytes, in the oldest version that holds its columns (see version),
        so older readers still read what they can."""
        return bytes(self._file_buffer())

    def _file_buffer(self) -> bytearray:
        """to_bytes's bytes, not copied into a bytes object (save writes them as they are)."""
        return encode(Parts(self.root, self.kind, self._hashes, self._sizes, self._offsets, self._path_index,
                            self._path_offsets, self._strings, self._meta, self._extras))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically (temp file + rename): readers never see half a file, and a crash
        (power loss included: the data reaches the disk before the rename) leaves the old
        digest or the new one, never an empty file in place of a good one."""
        write_atomic(path, self._file_buffer())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Digest:
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            if e.filename is None:  # a read error (EIO) names no file: name the digest
                e.filename = str(path)
            raise
        return cls.from_bytes(data, str(path))

    @classmethod
    def from_bytes(cls, data: bytes, name: str = "<bytes>") -> Digest:
        """Parse and check a digest; raises DigestError saying what is wrong."""
        parts = decode(data, name)
        try:
            return cls(*parts)
        except DigestError as e:  # the columns' own checks: name the file
            raise DigestError(f"{e} ({name})") from None
        except ValueError as e:  # bad UTF-8 in a path: only a buggy writer gets here
            raise DigestError(f"corrupt digest file {name}: {e}") from None


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
        return list(self._paths), np.array(self._pidx, U4)

    def build(self, targets: Sequence[int] | np.ndarray | None = None, classes: Sequence[str] = ()) -> Digest:
        poff, strings = packed(list(self._paths))
        extras = make_extras(targets, classes, None, bytes(self._blake3) if self._blake3 else None)
        if self._name_ends is not None:
            ends = np.zeros(len(self._name_ends) + 1, U8)
            ends[1:] = self._name_ends
            extras = extras._replace(name_offsets=readonly(ends), names=bytes(self._names))
        hashes = np.frombuffer(bytes(self._hashes), np.uint8).reshape(-1, 32)  # read-only: of bytes
        return Digest(self.root, self.kind, hashes, readonly(np.array(self._sizes, U8)),
                      readonly(np.array(self._offsets, U8)), readonly(np.array(self._pidx, U4)),
                      poff, strings, self.meta, extras)