"""Framing of the binary data plane (docs/protocol.md).

Why a second transport beside gRPC: Python gRPC copies each message several
times and moves ~0.5-1 GB/s on loopback; a length-prefixed frame written with
one sendmsg (values gathered straight from RocksDB buffers, no join) and read
with one recv(MSG_WAITALL) moves 2+ GB/s. Semantics are the same as the gRPC
calls (cacheserver/core.py serves both).

Every frame: a 20-byte header, then `body_len` bytes.
  header = magic "MLC1" | op or status (u8) | flags (u8) | aux_len (u16) |
           count (u32) | body_len (u64), little-endian.
Requests (op):
  LOOKUP, GET  body = job[aux_len] + count x 32-byte ids (GET flag COUNTED:
               a GET_LOCAL fallback, not counted twice)
  PUT          body = job[aux_len] + u16 dataset_len + dataset + i32 chunk
                      + count x (32-byte id + u64 size) + the values, concatenated
  PING         body = empty
  GET_LOCAL    as LOOKUP; a same-host reader announces a get whose values it
               reads itself from the store files (cacheserver/client/localread.py);
               flag INLINE: send the values it cannot read there yet inline
  CLAIM        as LOOKUP; the client is about to read these misses from the
               store (cacheserver/claims.py)
  OPEN_FOLLOWER body = empty; a same-host reader is about to open a follower:
               the server flushes a large memtable so the follower's replay is short
  ADOPT        body = job[aux_len] + u16 dataset_len + dataset + i32 chunk (>= 0)
                      + count x 32-byte ids: ids held as spare entries join the
                      chunk where they lie (no value travels)
Responses (status OK, else aux_len bytes of UTF-8 error message, no body):
  LOOKUP       body = count bytes, 1 present / 0 absent (GET_LOCAL alike);
               flag PENDING: 2 for absent ids another job has claimed
  GET_LOCAL    flag INLINE: as GET, with size LOCAL for a present value the
               reader is to read from the files; a present value not flushed
               yet (--durability cache) comes inline. A server from before
               the flag ignores it and answers count presence bytes.
  CLAIM        body = count bytes, 1 FETCH (yours) / 2 WAIT (another job's) /
               3 PRESENT (already cached)
  GET          body = count x u32 size (MISS = 0xFFFFFFFF) + present values
  PUT          body = 3 x u32: stored, already, rejected_full
  PING         body = the server's instance id (UTF-8)
  OPEN_FOLLOWER body = 1 byte: 1 if the server flushed
  ADOPT        body = count bytes, 1 held other than as spare now / 0 absent
"""
from __future__ import annotations

import socket
import ssl
import struct
from collections.abc import Sequence

MAGIC = b"MLC1"
HEADER = struct.Struct("<4sBBHIQ")
OP_LOOKUP, OP_GET, OP_PUT, OP_PING, OP_GET_LOCAL, OP_CLAIM, OP_OPEN_FOLLOWER, OP_ADOPT = 1, 2, 3, 4, 5, 6, 7, 8
OK, BAD_REQUEST, UNAVAILABLE, INTERNAL = 0, 1, 2, 3
FLAG_COUNTED = 1  # GET: the reader already counted this get through GET_LOCAL
FLAG_REPLACE = 2  # PUT: overwrite present ids (the reader found them poisoned)
FLAG_PENDING = 4  # LOOKUP: answer 2 for absent ids another job is reading from the store
FLAG_INLINE = 8  # GET_LOCAL: values not flushed yet come inline (a follower cannot see them)
FLAG_NOT_SPARE = 16  # LOOKUP: ids held only as spare entries count as absent
MISS = 0xFFFFFFFF
LOCAL = 0xFFFFFFFE  # GET_LOCAL with INLINE: present, read it from the store files
PUT_ENTRY = struct.Struct("<32sQ")
PUT_RESULT = struct.Struct("<III")
_IOV_MAX = 512  # stay well under the kernel's IOV_MAX (1024)


class ProtocolError(ConnectionError):
    """The peer sent something that is not a valid frame; the connection is unusable."""


class RemoteError(RuntimeError):
    """The server refused the request; `status` says how, the message says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def pack_header(op: int, aux_len: int, count: int, body_len: int, flags: int = 0) -> bytes:
    return HEADER.pack(MAGIC, op, flags, aux_len, count, body_len)


def unpack_header(raw: bytes) -> tuple[int, int, int, int]:
    op, _flags, aux_len, count, body_len = unpack_header_flags(raw)
    return op, aux_len, count, body_len


def unpack_header_flags(raw: bytes) -> tuple[int, int, int, int, int]:
    magic, op, flags, aux_len, count, body_len = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {magic!r} (expected {MAGIC!r}): not a data-plane peer")
    return op, flags, aux_len, count, body_len


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Read exactly n bytes: usually one syscall (MSG_WAITALL), no zero-filling."""
    if n == 0:
        return b""
    if not isinstance(sock, ssl.SSLSocket):
        data = sock.recv(n, socket.MSG_WAITALL)
        if len(data) == n:
            return data
        if not data:
            raise ConnectionError("connection closed by peer")
        buf = bytearray(data)
    else:
        buf = bytearray()
    while len(buf) < n:
        part = sock.recv(min(n - len(buf), 1 << 22))
        if not part:
            raise ConnectionError("connection closed by peer")
        buf += part
    return bytes(buf)


def send_buffers(sock: socket.socket, bufs: Sequence[bytes | memoryview]) -> None:
    """Gather-write all buffers without joining them (sendmsg), resuming after partial writes."""
    if isinstance(sock, ssl.SSLSocket):  # TLS sockets have no sendmsg
        for b in bufs:
            sock.sendall(b)
        return
    pending = [memoryview(b) for b in bufs if len(b)]
    i = 0
    while i < len(pending):
        sent = sock.sendmsg(pending[i:i + _IOV_MAX])
        while sent:
            head = pending[i]
            if sent >= len(head):
                sent -= len(head)
                i += 1
            else:
                pending[i] = head[sent:]
                sent = 0
