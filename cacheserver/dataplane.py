"""Binary data-plane server: bulk lookup/get/put over TCP and a same-host Unix socket.

One thread per connection; a connection carries one request at a time and
clients keep several connections for requests in flight. Shutdown: listeners
close, each connection finishes the request it is serving and then closes.
"""
from __future__ import annotations

import logging
import os
import select
import socket
import ssl
import struct
import threading

from . import wire
from .core import CacheCore
from .vocab import ID_LEN, BadRequest, split_ids

log = logging.getLogger("cacheserver.dataplane")
HANDSHAKE_SECONDS = 10.0
_U16 = struct.Struct("<H")
_I32 = struct.Struct("<i")


class DataPlaneServer:
    def __init__(self, core: CacheCore, instance: str, tcp: tuple[str, int] | None,
                 unix_path: str | None, ssl_ctx: ssl.SSLContext | None = None) -> None:
        self.core = core
        self.instance = instance
        self.ssl_ctx = ssl_ctx
        self._stopping = threading.Event()
        self._listeners: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._conns: set[threading.Thread] = set()
        self._conns_lock = threading.Lock()
        self.tcp_address: tuple[str, int] | None = None
        self.unix_path: str | None = None
        if tcp is not None:
            s = socket.create_server(tcp, family=socket.AF_INET6 if ":" in tcp[0] else socket.AF_INET,
                                     reuse_port=False, backlog=128)
            self.tcp_address = s.getsockname()[:2]
            self._listeners.append(s)
        if unix_path:
            if os.path.exists(unix_path):
                os.unlink(unix_path)  # stale socket of a previous run
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(unix_path)
            os.chmod(unix_path, 0o660)
            s.listen(128)
            self.unix_path = unix_path
            self._listeners.append(s)

    def start(self) -> None:
        for s in self._listeners:
            t = threading.Thread(target=self._accept_loop, args=(s,), daemon=True,
                                 name=f"dataplane-accept-{s.family.name}")
            t.start()
            self._threads.append(t)

    def _accept_loop(self, lsock: socket.socket) -> None:
        lsock.settimeout(0.2)
        while not self._stopping.is_set():
            try:
                conn, _ = lsock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            conn.settimeout(None)
            if conn.family != socket.AF_UNIX:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self.ssl_ctx is not None:
                    # The handshake runs in the connection's thread (see _serve): done here,
                    # one idle peer would block every later connection.
                    conn = self.ssl_ctx.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True, name="dataplane-conn")
            with self._conns_lock:
                self._conns.add(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            if isinstance(conn, ssl.SSLSocket):
                conn.settimeout(HANDSHAKE_SECONDS)
                try:
                    conn.do_handshake()
                except (ssl.SSLError, OSError) as e:
                    log.warning("dataplane TLS handshake failed: %s", e)
                    return
                conn.settimeout(None)
            while not self._stopping.is_set():
                # Wait for the next request without blocking shutdown.
                if not (isinstance(conn, ssl.SSLSocket) and conn.pending()):
                    ready, _, _ = select.select([conn], [], [], 0.25)
                    if not ready:
                        continue
                try:
                    head = wire.recv_exact(conn, wire.HEADER.size)
                except ConnectionError:
                    return
                if not self._handle(conn, head):
                    return
        except (ConnectionError, OSError) as e:
            log.debug("dataplane connection ended: %s", e)
        finally:
            conn.close()
            with self._conns_lock:
                self._conns.discard(threading.current_thread())

    def _reply_error(self, conn: socket.socket, status: int, message: str) -> None:
        msg = message.encode()[:65535]
        wire.send_buffers(conn, [wire.pack_header(status, len(msg), 0, 0), msg])

    def _handle(self, conn: socket.socket, head: bytes) -> bool:
        """Serve one request; False closes the connection (framing can't be trusted)."""
        try:
            op, flags, aux_len, count, body_len = wire.unpack_header_flags(head)
        except wire.ProtocolError as e:
            self.core.counters.add("bad_requests")
            self._reply_error(conn, wire.BAD_REQUEST, str(e))
            return False
        limits = self.core.limits
        # Put bodies hold values; other bodies hold ids and the job name.
        max_body = limits.max_batch_bytes + limits.max_batch_items * 48 + 70_000
        if body_len > max_body:
            self.core.counters.add("bad_requests")
            self._reply_error(conn, wire.BAD_REQUEST,
                              f"frame body of {body_len} bytes exceeds the limit of {max_body}")
            return False
        body = memoryview(wire.recv_exact(conn, body_len))
        self.core.counters.add("dataplane_requests")
        try:
            if aux_len > body_len:
                raise BadRequest(f"job name length {aux_len} exceeds the body ({body_len} bytes)")
            job = bytes(body[:aux_len]).decode()
            rest = body[aux_len:]
            if op in (wire.OP_LOOKUP, wire.OP_GET, wire.OP_GET_LOCAL, wire.OP_CLAIM):
                ids = _split_counted(rest, count)
                if op != wire.OP_GET:
                    if op == wire.OP_GET_LOCAL and flags & wire.FLAG_INLINE:
                        self._send_values(conn, self.core.get_local_inline(job, ids))
                        return True
                    if op == wire.OP_LOOKUP:
                        present = self.core.lookup(job, ids, pending=bool(flags & wire.FLAG_PENDING),
                                                   not_spare=bool(flags & wire.FLAG_NOT_SPARE))
                    else:
                        present = (self.core.get_local if op == wire.OP_GET_LOCAL else self.core.claim)(job, ids)
                    wire.send_buffers(conn, [wire.pack_header(wire.OK, 0, count, count), present])
                else:
                    self._send_values(conn, self.core.get(job, ids, count=not flags & wire.FLAG_COUNTED))
            elif op == wire.OP_PUT:
                stored, already, rejected = self.core.put(job, *_parse_put(rest, count),
                                                          replace=bool(flags & wire.FLAG_REPLACE))
                wire.send_buffers(conn, [wire.pack_header(wire.OK, 0, 3, wire.PUT_RESULT.size),
                                         wire.PUT_RESULT.pack(stored, already, rejected)])
            elif op == wire.OP_ADOPT:
                held = self.core.adopt(job, *_parse_adopt(rest, count))
                wire.send_buffers(conn, [wire.pack_header(wire.OK, 0, count, count), held])
            elif op == wire.OP_OPEN_FOLLOWER:
                flushed = bytes([self.core.open_follower()])
                wire.send_buffers(conn, [wire.pack_header(wire.OK, 0, 0, 1), flushed])
            elif op == wire.OP_PING:
                inst = self.instance.encode()
                wire.send_buffers(conn, [wire.pack_header(wire.OK, 0, 0, len(inst)), inst])
            else:
                raise BadRequest(f"unknown data-plane op {op}")
        except (BadRequest, UnicodeDecodeError) as e:
            self.core.counters.add("bad_requests")
            self._reply_error(conn, wire.BAD_REQUEST, str(e))
        except Exception as e:  # never let one request kill the server
            log.exception("dataplane request failed")
            self._reply_error(conn, wire.INTERNAL, f"internal error: {e}")
        return True

    def _send_values(self, conn: socket.socket, values: list[memoryview | bool | None]) -> None:
        """A GET body; True (GET_LOCAL INLINE) is sent as size LOCAL, with no bytes."""
        sizes = struct.pack(f"<{len(values)}I", *(wire.MISS if v is None else wire.LOCAL if v is True
                                                  else len(v) for v in values))
        present = [v for v in values if v is not None and v is not True]
        body_len = len(sizes) + sum(len(v) for v in present)
        wire.send_buffers(conn, [wire.pack_header(wire.OK, 0, len(values), body_len), sizes, *present])

    def stop(self, grace: float = 8.0) -> None:
        self._stopping.set()
        for s in self._listeners:
            s.close()
        if self.unix_path and os.path.exists(self.unix_path):
            os.unlink(self.unix_path)
        with self._conns_lock:
            conns = list(self._conns)
        for t in conns + self._threads:
            t.join(timeout=grace)


def _parse_tag(rest: memoryview, what: str) -> tuple[str, int, int]:
    """The (dataset, chunk) tag that heads put and adopt bodies, and where it ends."""
    if len(rest) < 2:
        raise BadRequest(f"{what} frame too short for the dataset name")
    (ds_len,) = _U16.unpack_from(rest, 0)
    pos = 2 + ds_len
    if len(rest) < pos + 4:
        raise BadRequest(f"{what} frame too short for the chunk tag")
    dataset = bytes(rest[2:pos]).decode()
    (chunk,) = _I32.unpack_from(rest, pos)
    return dataset, chunk, pos + 4


def _parse_adopt(rest: memoryview, count: int) -> tuple[list[bytes], str, int]:
    dataset, chunk, pos = _parse_tag(rest, "adopt")
    return _split_counted(rest[pos:], count), dataset, chunk


def _split_counted(raw: memoryview, count: int) -> list[bytes]:
    """The `count` ids a frame declares; a body of another length is refused."""
    if len(raw) != count * ID_LEN:
        raise BadRequest(f"{count} ids need {count * ID_LEN} bytes, frame has {len(raw)}")
    return split_ids(raw)


def _parse_put(rest: memoryview, count: int) -> tuple[list[tuple[bytes, int, memoryview]], str, int]:
    dataset, chunk, pos = _parse_tag(rest, "put")
    table_len = count * wire.PUT_ENTRY.size
    if len(rest) < pos + table_len:
        raise BadRequest(f"put frame too short for {count} item headers")
    items = []
    vpos = pos + table_len
    for i in range(count):
        key, size = wire.PUT_ENTRY.unpack_from(rest, pos + i * wire.PUT_ENTRY.size)
        if vpos + size > len(rest):
            raise BadRequest(f"items[{i}]: declared size {size} runs past the end of the frame")
        items.append((key, size, rest[vpos:vpos + size]))
        vpos += size
    if vpos != len(rest):
        raise BadRequest(f"put frame has {len(rest) - vpos} bytes beyond its {count} declared items")
    return items, dataset, chunk
