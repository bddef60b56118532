"""TFRecord framing, read and written without TensorFlow.

A TFRecord file is a sequence of records, each (little-endian)::

    u64 length | u32 masked_crc32c(length) | data[length] | u32 masked_crc32c(data)

Digests address a record by the offset of its ``data`` and its length, so a
cache miss can be served with a single range read.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import BinaryIO

from clients.crc32c import crc32c

HEADER_SIZE = 12  # u64 length + u32 masked crc of the length
FOOTER_SIZE = 4  # u32 masked crc of the data
_HEADER = struct.Struct("<QI")
_FOOTER = struct.Struct("<I")
_MASK_DELTA = 0xA282EAD8


class RecordError(ValueError):
    """A TFRecord file is malformed; the message names the file and offset."""


def masked_crc(data: bytes | bytearray | memoryview) -> int:
    """TFRecord's masked CRC-32C (masking avoids CRCs of CRCs being trivial)."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def encode_record(data: bytes) -> bytes:
    """One framed record, ready to append to a TFRecord file."""
    length = struct.pack("<Q", len(data))
    return b"".join(
        (length, _FOOTER.pack(masked_crc(length)), data, _FOOTER.pack(masked_crc(data)))
    )


def _read_exact(f: BinaryIO, n: int) -> bytes:
    # Raw files may return short reads before EOF; loop until n or EOF.
    data = f.read(n)
    if data is None or len(data) == n or not data:
        return data or b""
    parts = [data]
    got = len(data)
    while got < n:
        more = f.read(n - got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def compression(head: bytes) -> str | None:
    """'GZIP' or 'ZLIB' when a file's first bytes are that format's header."""
    if head[:2] == b"\x1f\x8b":
        return "GZIP"
    if len(head) >= 2 and head[0] & 0x0F == 8 and (head[0] << 8 | head[1]) % 31 == 0:
        return "ZLIB"
    return None


def iter_records(
    f: BinaryIO, name: str = "<stream>", verify_data_crc: bool = True
) -> Iterator[tuple[int, bytes]]:
    """Yield ``(data_offset, data)`` for each record of ``f`` (read from its start).

    The length CRC is always checked, before allocating ``length`` bytes, so a
    foreign file fails fast instead of attempting a huge read.  Raises
    :class:`RecordError` naming ``name`` and the record offset.
    """
    pos = 0
    while True:
        header = _read_exact(f, HEADER_SIZE)
        if not header:
            return
        if len(header) < HEADER_SIZE:
            raise RecordError(f"{name}: truncated record header at offset {pos}")
        length, length_crc = _HEADER.unpack(header)
        if masked_crc(header[:8]) != length_crc:
            if pos == 0 and compression(header):
                raise RecordError(
                    f"{name}: {compression(header)}-compressed (TFRecordWriter with "
                    f"compression_type={compression(header)!r}); compressed records cannot be "
                    "range-read: write the TFRecords uncompressed, or decompress the files first"
                )
            raise RecordError(
                f"{name}: bad length crc at offset {pos} (corrupt or not a TFRecord file)"
            )
        data = _read_exact(f, length)
        footer = _read_exact(f, FOOTER_SIZE)
        if len(data) < length or len(footer) < FOOTER_SIZE:
            raise RecordError(
                f"{name}: truncated record at offset {pos} (length {length})"
            )
        if verify_data_crc and masked_crc(data) != _FOOTER.unpack(footer)[0]:
            raise RecordError(f"{name}: bad data crc in record at offset {pos}")
        yield pos + HEADER_SIZE, data
        pos += HEADER_SIZE + length + FOOTER_SIZE
