"""Binary data-plane server: bulk lookup/get/put over TCP and a same-host Unix socket.

One thread per connection; a connection carries one request at a time and
clients keep several connections for requests in flight. Shutdown: listeners
close, each connection finishes the request it is serving and then closes.
"""
from __future__ import annotations

import logging
import os
import socket
import ssl
import stat
import threading
import time

from . import ops, wire
from .acceptloop import accept_forever, wait_readable
from .admission import Admission, AnswerBudget, Busy, answering
from .core import CacheCore
from .identity import dataplane_identity, set_peer
from .vocab import BadRequest

log = logging.getLogger("cacheserver.dataplane")
# A TLS handshake's whole time: CPython's do_handshake takes the socket timeout as one deadline for
# the call, not per read, so a peer dribbling its handshake holds a connection slot no longer.
HANDSHAKE_SECONDS = 10.0
# Slowest a request body or an answer may move on average: each must be whole within
# --request-timeout plus one second per MIN_RATE bytes. The timeout alone bounds a stall,
# so a peer dribbling a byte per timeout held its body's (or answer's) share of
# --max-inflight-bytes as long as it liked and a few of them kept every put busy.
MIN_RATE = 1 << 20
# Connections past --max-connections answered at once, each in a thread of its own: the
# reason is sent (under TLS after a handshake), then the client's first request is read
# and dropped, as a client reads its answer only after sending it (closed unread, the
# connection was reset under it and the answer lost). Past this many: plain ones are told
# the reason and closed at once, TLS ones closed unanswered.
REFUSERS = 8
REFUSED_REQUEST_WAIT_S = 1.0  # how long a refused connection's first request is waited for
# Ops that change nothing a busy answer would lose and answer values: their values count against the
# budget as they are read (admission.AnswerBudget), and a get none of whose values fit is answered busy.
VALUE_READS = frozenset({ops.GET.code, ops.GET_LOCAL.code})


class UnixSocketError(OSError):
    """The same-host socket cannot be made (named in the message); TCP may be fine."""


def _remove_stale_socket(path: str) -> None:
    """Remove what a previous run left at `path`; refuse anything else there: a server
    answering on it (two servers given one --unix-socket: the second took the first's
    clients away), or a file that is not a socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError("exists and is not a socket; not replaced")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except ConnectionRefusedError:  # nobody listens: a stale socket of a previous run
        os.unlink(path)
        return
    except OSError as e:  # no right to connect: whose it is cannot be told
        raise OSError(f"cannot tell whether a server uses it ({e}); not replaced") from None
    finally:
        probe.close()
    raise OSError("in use by a running server")


class DataPlaneServer:
    def __init__(self, core: CacheCore, instance: str, tcp: tuple[str, int] | None,
                 unix_path: str | None, ssl_ctx: ssl.SSLContext | None = None,
                 admission: Admission | None = None, unix_mode: int = 0o660) -> None:
        self.core = core
        # Shared with the gRPC server's calls (grpcadmit.py): one budget of request bytes.
        self.admission = admission or Admission(core.limits.max_inflight_bytes, core.limits.max_connections)
        self.instance = instance
        self.ssl_ctx = ssl_ctx
        self._stopping = threading.Event()
        self._listeners: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._conns: set[threading.Thread] = set()
        self._conns_lock = threading.Lock()
        self._refusers = threading.BoundedSemaphore(REFUSERS)
        self.tcp_address: tuple[str, int] | None = None
        self.unix_path: str | None = None
        if tcp is not None:
            s = socket.create_server(tcp, family=socket.AF_INET6 if ":" in tcp[0] else socket.AF_INET,
                                     reuse_port=False, backlog=128)
            self.tcp_address = s.getsockname()[:2]
            self._listeners.append(s)
        if unix_path:
            try:
                self._listen_unix(unix_path, unix_mode)
            except OSError as e:
                for s in self._listeners:
                    s.close()
                raise UnixSocketError(f"unix socket {unix_path}: cannot bind: {e}") from e

    def _listen_unix(self, unix_path: str, unix_mode: int) -> None:
        _remove_stale_socket(unix_path)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o777 & ~unix_mode)  # the socket never exists with wider permissions
        try:
            s.bind(unix_path)
        except OSError:
            s.close()
            raise
        finally:
            os.umask(old)
        os.chmod(unix_path, unix_mode)
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
        accept_forever(lsock, self._stopping, self._start_conn, lambda: self.core.counters.add("accept_errors"))

    def _start_conn(self, conn: socket.socket) -> None:
        why = self.admission.open_conn()
        if why:
            self._refuse_conn(conn, why)
            return
        try:
            conn = self._prepare(conn)
        except OSError as e:  # the peer reset it already (wrap_socket raises then): drop it, keep accepting
            self.admission.close_conn()
            conn.close()
            log.debug("dropped a data-plane connection reset before it was served: %s", e)
            return
        t = threading.Thread(target=self._serve, args=(conn,), daemon=True, name="dataplane-conn")
        with self._conns_lock:
            self._conns.add(t)
        try:
            t.start()
        except RuntimeError as e:  # no thread to be had: refuse this one, keep accepting
            with self._conns_lock:
                self._conns.discard(t)
            self.admission.close_conn()
            conn.close()
            log.error("refused a data-plane connection: %s", e)

    def _prepare(self, conn: socket.socket) -> socket.socket:
        conn.settimeout(None)
        if conn.family != socket.AF_UNIX:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.ssl_ctx is not None:
                # The handshake runs in the connection's thread (see _serve): done here,
                # one idle peer would block every later connection.
                conn = self.ssl_ctx.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        return conn

    def _refuse_conn(self, conn: socket.socket, why: str) -> None:
        """Answer a connection past the cap with the reason, then close it."""
        self.core.counters.add("busy_refused")
        if self._refusers.acquire(blocking=False):
            try:
                threading.Thread(target=self._refuse_in_thread, args=(conn, why), daemon=True,
                                 name="dataplane-refuse").start()
                return
            except RuntimeError:  # no thread to be had: as past REFUSERS
                self._refusers.release()
        try:
            if conn.family == socket.AF_UNIX or self.ssl_ctx is None:  # TLS would need a handshake first
                conn.settimeout(1.0)
                self._reply_error(conn, wire.UNAVAILABLE, why)
        except OSError:
            pass
        finally:
            conn.close()

    def _refuse_in_thread(self, conn: socket.socket, why: str) -> None:
        try:
            conn = self._prepare(conn)
            if isinstance(conn, ssl.SSLSocket):
                conn.settimeout(HANDSHAKE_SECONDS)
                conn.do_handshake()
            conn.settimeout(1.0)
            self._reply_error(conn, wire.UNAVAILABLE, why)
            self._drop_request(conn)
        except (ssl.SSLError, OSError) as e:
            log.debug("a data-plane connection refused busy did not take its answer: %s", e)
        finally:
            conn.close()
            self._refusers.release()

    def _drop_request(self, conn: socket.socket) -> None:
        """Read the refused connection's first request, if one comes soon, into nothing."""
        if not (isinstance(conn, ssl.SSLSocket) and conn.pending()):
            if not wait_readable(conn, REFUSED_REQUEST_WAIT_S):
                return
        conn.settimeout(self.core.limits.request_timeout_s)
        code, _, _, _, body_len = wire.unpack_header_flags(
            wire.recv_exact(conn, wire.HEADER.size, self._deadline(wire.HEADER.size)))
        if body_len <= self._max_body(code):
            wire.discard(conn, body_len, self._deadline(body_len))

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
            set_peer(dataplane_identity(conn))
            while not self._stopping.is_set():
                # Wait for the next request without blocking shutdown.
                if not (isinstance(conn, ssl.SSLSocket) and conn.pending()):
                    if not wait_readable(conn, 0.25):
                        continue
                conn.settimeout(self.core.limits.request_timeout_s)  # a stalled sender is cut off
                try:
                    head = wire.recv_exact(conn, wire.HEADER.size, self._deadline(wire.HEADER.size))
                except TimeoutError:  # a header begun, then stalled: as a stalled body
                    self._stalled()
                    return
                except ConnectionError:
                    return
                if not self._handle(conn, head):
                    return
                conn.settimeout(None)
        except (ConnectionError, OSError) as e:
            log.debug("dataplane connection ended: %s", e)
        finally:
            conn.close()
            self.admission.close_conn()
            with self._conns_lock:
                self._conns.discard(threading.current_thread())

    def _deadline(self, n: int) -> float:
        """When a transfer of n bytes starting now must be done (MIN_RATE)."""
        return time.monotonic() + self.core.limits.request_timeout_s + n / MIN_RATE

    def _stalled(self) -> None:
        self.core.counters.add("request_timeouts")
        log.warning("closed a data-plane connection whose request stalled for %.0f s or arrived slower than "
                    "%d KiB/s", self.core.limits.request_timeout_s, MIN_RATE >> 10)

    def _reply_error(self, conn: socket.socket, status: int, message: str) -> None:
        msg = message.encode()[:65535]
        wire.send_buffers(conn, [wire.pack_header(status, len(msg), 0, 0), msg])

    def _handle(self, conn: socket.socket, head: bytes) -> bool:
        """Serve one request; False closes the connection (framing can't be trusted)."""
        try:
            code, flags, aux_len, count, body_len = wire.unpack_header_flags(head)
        except wire.ProtocolError as e:
            return self._refuse(conn, str(e))
        max_body = self._max_body(code)
        if body_len > max_body:
            return self._refuse(conn, f"frame body of {body_len} bytes exceeds the limit of {max_body}")
        why = self.admission.admit(body_len)
        if why:
            return self._refuse_busy(conn, body_len, why)
        try:
            return self._serve_body(conn, code, flags, aux_len, count, body_len)
        finally:
            self.admission.release(body_len)

    def _max_body(self, code: int) -> int:
        """Put bodies hold values; other bodies hold ids and the job name."""
        limits = self.core.limits
        return limits.max_batch_items * 48 + 70_000 + (limits.max_batch_bytes if code == ops.PUT.code else 0)

    def _refuse_busy(self, conn: socket.socket, body_len: int, why: str) -> bool:
        """Answer 'server busy' once the body is read into nothing (no memory held). A client
        reads its answer only after sending the whole request: closed with the body unread, the
        connection was reset under it, and it took a busy server for a dead one (a growing
        back-off, and its claims on the put's items kept until their ttl, ring_client.py)."""
        self.core.counters.add("busy_refused")
        try:
            wire.discard(conn, body_len, self._deadline(body_len))
        except TimeoutError:  # a stalled sender: say why, then cut it off
            self._reply_error(conn, wire.UNAVAILABLE, why)
            return False
        self._reply_error(conn, wire.UNAVAILABLE, why)
        return True

    def _serve_body(self, conn: socket.socket, code: int, flags: int, aux_len: int, count: int,
                    body_len: int) -> bool:
        try:
            body = memoryview(wire.recv_exact(conn, body_len, self._deadline(body_len)))
        except TimeoutError:
            self._stalled()
            return False
        self.core.counters.add("dataplane_requests")
        budget = None
        if code in VALUE_READS:
            why = self.admission.full(held=body_len)
            if why:  # no room for any answer: not even read
                return self._reply_busy(conn, why)
            budget = AnswerBudget(self.admission, held=body_len)
        try:
            return self._serve_op(conn, (code, flags, aux_len, count), body, budget)
        finally:
            if budget is not None:
                budget.release()

    def _serve_op(self, conn: socket.socket, head: tuple[int, int, int, int], body: memoryview,
                  budget: AnswerBudget | None) -> bool:
        """Answer one request whose body is read; ``budget`` counts the values it reads."""
        try:
            with answering(budget):
                rcount, parts = self._answer(*head, body)
        except Busy as e:  # none of the get's values fit: nothing read is held, nothing counted
            if budget is not None:
                budget.release()  # before the answer: a client's next request may come right after it
            return self._reply_busy(conn, str(e))
        except (BadRequest, UnicodeDecodeError) as e:
            self.core.counters.add("bad_requests")
            self._reply_error(conn, wire.BAD_REQUEST, str(e))
            return True
        except Exception as e:  # never let one request kill the server
            log.exception("dataplane request failed")
            self._reply_error(conn, wire.INTERNAL, f"internal error: {e}")
            return True
        size = sum(len(p) for p in parts)
        # What the budget did not count as read (framing, small answers of other ops): the
        # operation is done, so counted, never refused.
        extra = max(0, size - (budget.taken if budget is not None else 0))
        self.admission.admit(extra, force=True)
        try:
            return self._send_answer(conn, rcount, parts, size)
        finally:
            self.admission.release(extra)

    def _reply_busy(self, conn: socket.socket, why: str) -> bool:
        self.core.counters.add("busy_refused")
        self._reply_error(conn, wire.UNAVAILABLE, why)
        return True

    def _send_answer(self, conn: socket.socket, rcount: int, parts: list, size: int) -> bool:
        try:
            wire.send_buffers(conn, [wire.pack_header(wire.OK, 0, rcount, size), *parts], self._deadline(size))
        except TimeoutError:  # the reader took nothing for a whole timeout, or took it too slowly
            self.core.counters.add("reply_stalls")
            log.warning("closed a data-plane connection whose reader took nothing for %.0f s or read slower "
                        "than %d KiB/s", self.core.limits.request_timeout_s, MIN_RATE >> 10)
            return False  # part of the answer is out: the framing cannot go on
        return True

    def _answer(self, code: int, flags: int, aux_len: int, count: int, body: memoryview) -> tuple[int, list]:
        """The answer (count, body parts) of the operation `code` (ops.TABLE)."""
        if aux_len > len(body):
            raise BadRequest(f"job name length {aux_len} exceeds the body ({len(body)} bytes)")
        if count > self.core.limits.max_batch_items:  # before parsing makes objects per declared item
            raise BadRequest(f"batch of {count} items exceeds the limit of {self.core.limits.max_batch_items}")
        job = bytes(body[:aux_len]).decode()
        op = ops.TABLE.get(code)
        if op is None:
            raise BadRequest(f"unknown data-plane op {code}")
        if op is ops.PING:
            return 0, [self.instance.encode()]
        return op.serve(self.core, job, flags, count, body[aux_len:])

    def _refuse(self, conn: socket.socket, message: str) -> bool:
        """A frame whose framing cannot be trusted: say why, then close."""
        self.core.counters.add("bad_requests")
        self._reply_error(conn, wire.BAD_REQUEST, message)
        return False

    def stop(self, grace: float = 8.0) -> None:
        self._stopping.set()
        for s in self._listeners:
            s.close()
        if self.unix_path and os.path.exists(self.unix_path):
            os.unlink(self.unix_path)
        with self._conns_lock:
            conns = list(self._conns)
        deadline = time.monotonic() + grace  # one grace for all: n stalled connections waited n graces
        for t in conns + self._threads:
            if t.ident is not None:  # one being started as the server stops finds _stopping set
                t.join(timeout=max(0.0, deadline - time.monotonic()))
