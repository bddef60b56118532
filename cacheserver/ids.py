"""Ids are 32 bytes: the client derives them from content digests, the server
only checks their shape."""
from __future__ import annotations

ID_LEN = 32


class BadRequest(ValueError):
    """A request the server refuses as a whole; the message names what is wrong."""


def split_ids(blob: bytes | memoryview, what: str = "ids") -> list[bytes]:
    """Split concatenated ids; a length that is not a multiple of 32 is refused."""
    n = len(blob)
    if n % ID_LEN:
        raise BadRequest(f"{what}: {n} bytes is not a whole number of {ID_LEN}-byte ids")
    b = bytes(blob)
    return [b[i:i + ID_LEN] for i in range(0, n, ID_LEN)]

