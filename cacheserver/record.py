"""On-disk value record: value || xxh3_64(value), 8 bytes little-endian.

Shared by the server's store and same-host readers, so both refuse a record
that fails its checksum."""
from __future__ import annotations

import xxhash

TRAILER = 8


def wrap(value: bytes | memoryview) -> bytes:
    return b"".join((value, xxhash.xxh3_64_intdigest(value).to_bytes(TRAILER, "little")))


def unwrap(raw: bytes) -> memoryview | None:
    """The value as a zero-copy view, or None if the record is damaged."""
    if len(raw) < TRAILER:
        return None
    mv = memoryview(raw)[:-TRAILER]
    if xxhash.xxh3_64_intdigest(mv).to_bytes(TRAILER, "little") != raw[-TRAILER:]:
        return None
    return mv


def strip(raw: bytes) -> memoryview | None:
    """The value without checking its trailer, for a reader that authenticates it itself
    (the embedded server's own process: every value's AES-GCM tag); None if too short."""
    return memoryview(raw)[:-TRAILER] if len(raw) >= TRAILER else None
