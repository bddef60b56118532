"""CRC-32C (Castagnoli), as used by the TFRecord framing.

Uses the C implementation from the optional ``google-crc32c`` package when it
is installed (gcsfs pulls it in); otherwise a pure-Python table, which is
correct but slow (a few MB/s), so large TFRecord datasets should install
``google-crc32c``.
"""

from __future__ import annotations

from typing import Any

_POLY = 0x82F63B78  # reflected Castagnoli polynomial


def _make_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ _POLY if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _make_table()


def crc32c_py(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """Pure-Python CRC-32C of ``data``, continuing from ``crc``."""
    table = _TABLE
    c = crc ^ 0xFFFFFFFF
    for b in bytes(data):
        c = table[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


_g: Any
try:
    import google_crc32c as _g

    # The package ships its own slow pure-Python fallback; only prefer it
    # when the C extension is actually in use.
    FAST = _g.implementation == "c"
except ImportError:  # optional dependency
    _g = None
    FAST = False


def crc32c(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """CRC-32C of ``data``, continuing from ``crc`` (0 to start)."""
    if FAST:
        # The C extension only takes immutable bytes.
        return _g.extend(crc, data if isinstance(data, bytes) else bytes(data))
    return crc32c_py(data, crc)
