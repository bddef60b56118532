"""Framing of the binary data plane (docs/protocol.md).

Why a second transport beside gRPC: Python gRPC copies each message several
times and moves ~0.5-1 GB/s on loopback; a length-prefixed frame written with
one sendmsg (values gathered straight from RocksDB buffers, no join) and read
with one recv(MSG_WAITALL) moves 2+ GB/s. Semantics are the same as the gRPC
calls (cacheserver/core.py serves both).

Every frame: a 20-byte header, then `body_len` bytes.
  header = magic "MLC1" | op or status (u8) | flags (u8) | aux_len (u16) |
           count (u32) | body_len (u64), little-endian.
The operations (op codes, bodies, flags, answers) are declared in ops.py.
Answers carry status OK, else aux_len bytes of UTF-8 error message and no body.
"""
from __future__ import annotations

import socket
import ssl
import struct
import time
from collections.abc import Sequence

import numpy

MAGIC = b"MLC1"
HEADER = struct.Struct("<4sBBHIQ")
OK, BAD_REQUEST, UNAVAILABLE, INTERNAL = 0, 1, 2, 3
_IOV_MAX = 512  # stay well under the kernel's IOV_MAX (1024)
_SMALL = 1 << 16  # frames up to this size are read with one recv, as bytes
# A TLS write of one buffer runs under one deadline (the socket's timeout) however long
# the buffer: written in slices, the timeout bounds a stall, not a slow reader's whole answer.
TLS_SLICE = 256 << 10
# What discard() reads into, shared by every connection: the bytes are dropped, so a
# refused body costs no memory however many connections refuse one at once.
_DISCARD = memoryview(bytearray(256 << 10))


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


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes | memoryview:
    """Read exactly n bytes: bytes up to _SMALL (usually one syscall, MSG_WAITALL),
    else a memoryview of one uninitialised buffer of the final size that the parts
    are received into in place: no zero-filling, no second copy, no growing.
    The socket's timeout bounds each stall; `deadline` (time.monotonic()) the whole read:
    past it TimeoutError, however steadily the bytes trickle in."""
    if n == 0:
        return b""
    with _Paced(sock, deadline) as pace:
        if n > _SMALL:
            view = memoryview(numpy.empty(n, numpy.uint8))
            _recv_into(sock, view, 0, pace)
            return view
        pace()
        data = b"" if isinstance(sock, ssl.SSLSocket) else sock.recv(n, socket.MSG_WAITALL)
        if len(data) == n:
            return data
        if not data and not isinstance(sock, ssl.SSLSocket):
            raise ConnectionError("connection closed by peer")
        # A socket with a timeout is non-blocking underneath: MSG_WAITALL returns what has come.
        buf = bytearray(n)
        buf[:len(data)] = data
        with memoryview(buf) as view:
            _recv_into(sock, view, len(data), pace)
        return bytes(buf)


class _Paced:
    """Calling it before each socket call shortens the socket's timeout (the stall bound) to
    what is left before `deadline` once that is less, raising TimeoutError once none is; the
    timeout is put back on the way out. Each settimeout is a syscall, so a transfer that ends
    well before its deadline (every one on the hit path) makes none. Without a deadline it
    does nothing (clients, and the unbounded default)."""

    def __init__(self, sock: socket.socket, deadline: float | None) -> None:
        self.sock, self.deadline = sock, deadline
        self.stall = sock.gettimeout() if deadline is not None else None
        self.shortened = False

    def __enter__(self) -> "_Paced":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.shortened:
            self.sock.settimeout(self.stall)

    def __call__(self) -> None:
        if self.deadline is None:
            return
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the transfer passed its deadline")
        if self.stall is None or left < self.stall:
            self.sock.settimeout(left)
            self.shortened = True


def _recv_into(sock: socket.socket, view: memoryview, got: int, pace: _Paced) -> None:
    n = len(view)
    while got < n:
        pace()
        k = sock.recv_into(view[got:], min(n - got, 1 << 22))
        if not k:
            raise ConnectionError("connection closed by peer")
        got += k


def discard(sock: socket.socket, n: int, deadline: float | None = None) -> None:
    """Read n bytes and drop them: the rest of a frame not served, so the connection goes on
    (`deadline`: as recv_exact's)."""
    with _Paced(sock, deadline) as pace:
        while n > 0:
            pace()
            k = sock.recv_into(_DISCARD, min(n, len(_DISCARD)))
            if not k:
                raise ConnectionError("connection closed by peer")
            n -= k


def send_buffers(sock: socket.socket, bufs: Sequence[bytes | memoryview], deadline: float | None = None) -> None:
    """Gather-write all buffers without joining them (sendmsg), resuming after partial writes.
    The socket's timeout bounds each wait for the peer to take more bytes, not the whole write;
    `deadline` (time.monotonic()) bounds the whole write: past it TimeoutError."""
    with _Paced(sock, deadline) as pace:
        if isinstance(sock, ssl.SSLSocket):  # TLS sockets have no sendmsg
            for b in bufs:
                with memoryview(b).cast("B") as view:
                    for at in range(0, len(view), TLS_SLICE):
                        pace()
                        sock.sendall(view[at:at + TLS_SLICE])
            return
        pending = [memoryview(b) for b in bufs if len(b)]
        i = 0
        while i < len(pending):
            pace()
            sent = sock.sendmsg(pending[i:i + _IOV_MAX])
            while sent:
                head = pending[i]
                if sent >= len(head):
                    sent -= len(head)
                    i += 1
                else:
                    pending[i] = head[sent:]
                    sent = 0
